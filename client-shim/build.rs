fn main() {
    // NVIDIA's libcudart dlopen()s "libcuda.so.1"; the soname makes a link
    // against this library (-lcuda) record that name too.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
