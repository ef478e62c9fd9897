fn main() {
    // Tools dlopen() "libnvidia-ml.so.1"; the soname makes a link against this library
    // (-lnvidia-ml) record that name too.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
