//! `cuda_entry_points!`: the shim's exported CUDA driver API, generated from the committed
//! declarations in `client-shim/src/cuda/functions.rs` (written by `tools/rgpu-bindgen`).
//!
//! ```ignore
//! rgpu_shim_macros::cuda_entry_points! {
//!     implemented: [cuGetProcAddress, cuGetProcAddress_v2, cuInit, cuMemAllocAsync, cuMemAlloc_v2],
//!     aliases: [cuMemAllocAsync_ptsz => cuMemAllocAsync],
//! }
//! ```
//!
//! The macro reads `$CARGO_MANIFEST_DIR/src/cuda/functions.rs` of the invoking crate (and
//! `include_bytes!`s it, so cargo rebuilds when it changes) and emits, in a module `exports`:
//!
//! - for **every** declared function, `pub unsafe extern "C" fn <name>(<C args>) -> CUresult`,
//!   `#[no_mangle]` except under `cfg(test)` (so unit tests can link beside a real libcuda);
//! - for names in `implemented`, the body
//!   `crate::entry::call("<name>", &[<args as Debug>], move || unsafe {
//!   crate::r#impl::<module>::<fn>(<FromCuda::from_cuda(arg)?>...) })`, where the implementation
//!   is `pub(crate) unsafe fn <fn>(<one parameter per C argument>) -> CuResult<()>` and each
//!   parameter has the C argument's type or one `crate::entry::FromCuda` converts it to
//!   (`&mut T` or `Option<&mut T>` for a `*mut T`);
//! - for names in `aliases` (`cuStreamQuery_ptsz => cuStreamQuery`: versioned and per-thread
//!   variants with the same C signature and the same meaning in rgpu), the body of the target,
//!   traced under the alias's own name;
//! - for every other name, `crate::entry::unsupported("<name>", &LOGGED)`, which logs the name
//!   once (per name, process-wide) and returns `CUDA_ERROR_NOT_SUPPORTED`;
//! - `pub(crate) fn symbol_address(name: &str) -> Option<*mut c_void>` at the invocation site:
//!   the address of any exported entry point, by exact symbol name.
//!
//! The argument types are spelled as in `functions.rs` and resolved through
//! `use crate::cuda::types::*;` inside `exports`.
//!
//! `implemented` and `aliases` must be sorted (byte order, as `sort` with `LC_ALL=C` or Rust's `str` ordering
//! sorts: `cuMemAllocHost_v2` comes before `cuMemAlloc_v2`), without duplicates, and name only
//! declared functions (an alias: a declared function not itself implemented, whose target is
//! implemented and has the same C signature); the macro reports a compile error otherwise.
//!
//! # Name → module rule
//!
//! A driver API name `cu<Rest>` becomes `<module>::<function>`:
//!
//! 1. The **longest known prefix** that ends at a word boundary (the next character is not a
//!    lowercase letter, so `cuGraph` does not match `cuGraphicsMapResources`) picks the module:
//!
//!    | prefix | module | kept in the function name |
//!    |---|---|---|
//!    | `cuDevicePrimaryCtx` | `primary_context` | |
//!    | `cuDevice` | `device` | |
//!    | `cuCtx` | `context` | |
//!    | `cuMemcpy`, `cuMemset` | `memory` | `Memcpy`/`Memset` |
//!    | `cuMem` | `memory` | |
//!    | `cuMemAllocManaged`, `cuMemPrefetch`, `cuMemAdvise`, `cuMemRange` | `managed` | all of it after `cuMem` |
//!    | `cuMemCreate`, `cuMemRelease`, `cuMemAddress`, `cuMemMap`, `cuMemUnmap`, `cuMemSetAccess`, `cuMemGetAccess`, `cuMemGetAllocation`, `cuMemRetainAllocationHandle`, `cuMem{Export,Import}*ShareableHandle` | `vmm` | all of it after `cuMem` |
//!    | `cuModule` | `module` | |
//!    | `cuLibrary` | `library` | |
//!    | `cuKernel` | `kernel` | |
//!    | `cuFunc` | `function` | |
//!    | `cuLaunch` | `launch` | |
//!    | `cuStream` | `stream` | |
//!    | `cuEvent` | `event` | |
//!    | `cuOccupancy` | `occupancy` | |
//!    | `cuPointer` | `pointer` | |
//!    | `cuGraph` | `graph` | |
//!    | `cuArray` (so also `cuArray3D`) | `array` | |
//!    | `cuTexRef`, `cuTexObject`, `cuSurf` | `texture` | `TexRef`/`TexObject`/`Surf` |
//!    | `cuLink` | `link` | |
//!    | `cuIpc` | `ipc` | |
//!    | `cuProfiler` | `profiler` | |
//!    | anything else (`cu`) | `driver` | |
//!
//!    The texture prefixes are kept because `cuTexRefCreate`, `cuTexObjectCreate` and
//!    `cuSurfObjectCreate` would otherwise all be `texture::create`.
//! 2. The remainder after the prefix becomes snake_case: a new word starts at each uppercase
//!    letter after a lowercase letter or digit, and at the last capital of an acronym
//!    (`GetPCIBusId` → `get_pci_bus_id`); `_` separates words; digits stay with the word before
//!    (`WaitValue32` → `wait_value32`, `_v2` → `_v2`). These are single words wherever a word
//!    may start (and not followed by a lowercase letter or digit): `HtoD DtoH DtoD HtoA AtoH DtoA
//!    AtoD AtoA D2D8 D2D16 D2D32 P2P 1D 2D 3D D8 D16 D32`.
//! 3. If the remainder is empty or would start with a digit, the module's own word is kept:
//!    `cuLaunch` → `launch::launch`, `cuArray3DCreate_v2` → `array::array_3d_create_v2`.
//!
//! Examples: `cuMemcpyHtoD_v2` → `memory::memcpy_htod_v2`, `cuMemsetD8Async` →
//! `memory::memset_d8_async`, `cuMemcpy2DAsync_v2` → `memory::memcpy_2d_async_v2`,
//! `cuMemHostAlloc` → `memory::host_alloc`, `cuCtxGetCurrent` → `context::get_current`,
//! `cuDevicePrimaryCtxRetain` → `primary_context::retain`, `cuStreamCreate` → `stream::create`,
//! `cuEventDestroy_v2` → `event::destroy_v2`, `cuLaunchKernel` → `launch::kernel`,
//! `cuInit` → `driver::init`, `cuGetProcAddress_v2` → `driver::get_proc_address_v2`,
//! `cuGetExportTable` → `driver::get_export_table`.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{bracketed, FnArg, ForeignItem, Ident, Item, Pat, Token};

/// Where `functions.rs` lives, relative to the invoking crate's manifest directory.
const FUNCTIONS_PATH: &str = "src/cuda/functions.rs";

/// (prefix, module, part of the prefix kept in the function name).
const PREFIXES: &[(&str, &str, &str)] = &[
    ("cuDevicePrimaryCtx", "primary_context", ""),
    ("cuDevice", "device", ""),
    ("cuCtx", "context", ""),
    ("cuMemcpy", "memory", "Memcpy"),
    ("cuMemset", "memory", "Memset"),
    ("cuMem", "memory", ""),
    ("cuMemAllocManaged", "managed", "AllocManaged"),
    ("cuMemPrefetch", "managed", "Prefetch"),
    ("cuMemAdvise", "managed", "Advise"),
    ("cuMemRange", "managed", "Range"),
    ("cuMemAddress", "vmm", "Address"),
    ("cuMemCreate", "vmm", "Create"),
    ("cuMemRelease", "vmm", "Release"),
    ("cuMemMap", "vmm", "Map"),
    ("cuMemUnmap", "vmm", "Unmap"),
    ("cuMemSetAccess", "vmm", "SetAccess"),
    ("cuMemGetAccess", "vmm", "GetAccess"),
    ("cuMemGetAllocation", "vmm", "GetAllocation"),
    ("cuMemRetainAllocationHandle", "vmm", "RetainAllocationHandle"),
    ("cuMemExportToShareableHandle", "vmm", "ExportToShareableHandle"),
    ("cuMemImportFromShareableHandle", "vmm", "ImportFromShareableHandle"),
    ("cuModule", "module", ""),
    ("cuLibrary", "library", ""),
    ("cuKernel", "kernel", ""),
    ("cuFunc", "function", ""),
    ("cuLaunch", "launch", ""),
    ("cuStream", "stream", ""),
    ("cuEvent", "event", ""),
    ("cuOccupancy", "occupancy", ""),
    ("cuPointer", "pointer", ""),
    ("cuGraph", "graph", ""),
    ("cuArray", "array", ""),
    ("cuTexRef", "texture", "TexRef"),
    ("cuTexObject", "texture", "TexObject"),
    ("cuSurf", "texture", "Surf"),
    ("cuLink", "link", ""),
    ("cuIpc", "ipc", ""),
    ("cuProfiler", "profiler", ""),
];

/// Tokens that are one word in snake_case, longest first where one is a prefix of another.
const SPECIAL_WORDS: &[&str] = &[
    "D2D16", "D2D32", "D2D8", "HtoD", "DtoH", "DtoD", "HtoA", "AtoH", "DtoA", "AtoD", "AtoA",
    "P2P", "D16", "D32", "D8", "1D", "2D", "3D",
];

/// `cuMemAlloc_v2` → `("memory", "alloc_v2")`; see the crate documentation for the rule.
pub(crate) fn normalize(name: &str) -> (String, String) {
    let mut best: Option<(&str, &str, &str)> = None;
    for &(prefix, module, keep) in PREFIXES {
        if let Some(rest) = name.strip_prefix(prefix) {
            let at_boundary = !rest.starts_with(|c: char| c.is_ascii_lowercase());
            if at_boundary && !matches!(best, Some((p, _, _)) if p.len() >= prefix.len()) {
                best = Some((prefix, module, keep));
            }
        }
    }
    let (module, rest, keep) = match best {
        Some((prefix, module, keep)) => (module, &name[prefix.len()..], keep),
        None => ("driver", name.strip_prefix("cu").unwrap_or(name), ""),
    };
    let mut function = snake_case(&format!("{keep}{rest}"));
    if function.is_empty() || function.starts_with(|c: char| c.is_ascii_digit()) {
        let word = module.split('_').next_back().unwrap_or(module);
        function = if function.is_empty() { word.to_string() } else { format!("{word}_{function}") };
    }
    (module.to_string(), function)
}

fn special_at(s: &str, i: usize) -> Option<&'static str> {
    SPECIAL_WORDS.iter().copied().find(|w| {
        s[i..].starts_with(w)
            && !s[i + w.len()..].starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
    })
}

pub(crate) fn snake_case(s: &str) -> String {
    let b = s.as_bytes();
    let mut words: Vec<String> = vec![];
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'_' {
            i += 1;
            continue;
        }
        if let Some(w) = special_at(s, i) {
            words.push(w.to_ascii_lowercase());
            i += w.len();
            continue;
        }
        let start = i;
        i += 1;
        if b[start].is_ascii_uppercase() {
            // An acronym: a run of capitals, minus the last one if a lowercase letter follows.
            while i < b.len()
                && b[i].is_ascii_uppercase()
                && !(i + 1 < b.len() && b[i + 1].is_ascii_lowercase())
                && special_at(s, i).is_none()
            {
                i += 1;
            }
        }
        while i < b.len()
            && (b[i].is_ascii_lowercase() || b[i].is_ascii_digit())
            && special_at(s, i).is_none()
        {
            i += 1;
        }
        words.push(s[start..i].to_ascii_lowercase());
    }
    words.join("_")
}

struct Input {
    implemented: Vec<Ident>,
    /// (alias, the implemented function it runs).
    aliases: Vec<(Ident, Ident)>,
}

struct Alias {
    name: Ident,
    target: Ident,
}

impl Parse for Alias {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let name: Ident = input.parse()?;
        input.parse::<Token![=>]>()?;
        let target: Ident = input.parse()?;
        Ok(Alias { name, target })
    }
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let key: Ident = input.parse()?;
        if key != "implemented" {
            return Err(syn::Error::new(key.span(), "expected `implemented: [ ... ]`"));
        }
        input.parse::<Token![:]>()?;
        let content;
        bracketed!(content in input);
        let names: Punctuated<Ident, Token![,]> = Punctuated::parse_terminated(&content)?;
        let _ = input.parse::<Option<Token![,]>>()?;
        let mut aliases = vec![];
        if !input.is_empty() {
            let key: Ident = input.parse()?;
            if key != "aliases" {
                return Err(syn::Error::new(key.span(), "expected `aliases: [ NAME => TARGET, ... ]`"));
            }
            input.parse::<Token![:]>()?;
            let content;
            bracketed!(content in input);
            let list: Punctuated<Alias, Token![,]> = Punctuated::parse_terminated(&content)?;
            aliases = list.into_iter().map(|a| (a.name, a.target)).collect();
            let _ = input.parse::<Option<Token![,]>>()?;
        }
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the `aliases` list"));
        }
        Ok(Input { implemented: names.into_iter().collect(), aliases })
    }
}

struct Declaration {
    name: Ident,
    args: Vec<(Ident, syn::Type)>,
    output: syn::ReturnType,
}

fn parse_declarations(text: &str) -> syn::Result<Vec<Declaration>> {
    let file = syn::parse_file(text)?;
    let mut out = vec![];
    for item in file.items {
        let Item::ForeignMod(block) = item else { continue };
        for item in block.items {
            let ForeignItem::Fn(f) = item else { continue };
            let mut args = vec![];
            for (n, arg) in f.sig.inputs.iter().enumerate() {
                let FnArg::Typed(arg) = arg else {
                    return Err(syn::Error::new(Span::call_site(), "unexpected receiver"));
                };
                let ident = match &*arg.pat {
                    Pat::Ident(p) => p.ident.clone(),
                    _ => format_ident!("arg{}", n),
                };
                args.push((ident, (*arg.ty).clone()));
            }
            out.push(Declaration { name: f.sig.ident.clone(), args, output: f.sig.output.clone() });
        }
    }
    Ok(out)
}

/// Emits every exported CUDA driver entry point; see the crate documentation.
#[proc_macro]
pub fn cuda_entry_points(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as Input);
    match expand(input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(input: Input) -> syn::Result<TokenStream2> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")
        .map_err(|_| syn::Error::new(Span::call_site(), "CARGO_MANIFEST_DIR is not set"))?;
    let path = std::path::Path::new(&manifest_dir).join(FUNCTIONS_PATH);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        syn::Error::new(Span::call_site(), format!("cannot read {}: {e}", path.display()))
    })?;
    let decls = parse_declarations(&text)?;
    let declared: std::collections::BTreeSet<String> =
        decls.iter().map(|d| d.name.to_string()).collect();

    // Check the implemented list.
    let mut implemented = std::collections::BTreeSet::new();
    let mut previous: Option<String> = None;
    for name in &input.implemented {
        let s = name.to_string();
        if !declared.contains(&s) {
            return Err(syn::Error::new(name.span(), format!("`{s}` is not declared in {FUNCTIONS_PATH}")));
        }
        if !implemented.insert(s.clone()) {
            return Err(syn::Error::new(name.span(), format!("`{s}` is listed twice")));
        }
        if let Some(p) = &previous {
            if *p > s {
                return Err(syn::Error::new(
                    name.span(),
                    format!("keep `implemented` sorted: `{s}` must come before `{p}`"),
                ));
            }
        }
        previous = Some(s);
    }

    // Check the aliases: each names a declared, not implemented function and an implemented
    // one with exactly the same C signature.
    let by_name: std::collections::BTreeMap<String, &Declaration> =
        decls.iter().map(|d| (d.name.to_string(), d)).collect();
    let signature = |d: &Declaration| {
        let args: Vec<String> = d.args.iter().map(|(_, t)| quote!(#t).to_string()).collect();
        let out = &d.output;
        format!("({}) {}", args.join(", "), quote!(#out))
    };
    let mut alias_of = std::collections::BTreeMap::new();
    let mut previous: Option<String> = None;
    for (alias, target) in &input.aliases {
        let (a, t) = (alias.to_string(), target.to_string());
        let Some(ad) = by_name.get(&a) else {
            return Err(syn::Error::new(alias.span(), format!("`{a}` is not declared in {FUNCTIONS_PATH}")));
        };
        if implemented.contains(&a) {
            return Err(syn::Error::new(alias.span(), format!("`{a}` is implemented; it cannot also be an alias")));
        }
        if !implemented.contains(&t) {
            return Err(syn::Error::new(target.span(), format!("alias target `{t}` is not in `implemented`")));
        }
        let td = by_name[&t];
        if signature(ad) != signature(td) {
            return Err(syn::Error::new(
                alias.span(),
                format!("`{a}` {} and `{t}` {} differ in signature", signature(ad), signature(td)),
            ));
        }
        if let Some(p) = &previous {
            if *p >= a {
                return Err(syn::Error::new(alias.span(), format!("keep `aliases` sorted, without duplicates: `{a}` after `{p}`")));
            }
        }
        previous = Some(a.clone());
        alias_of.insert(a, t);
    }

    // A program built with `--default-stream per-thread` reaches a function's `_ptds` or
    // `_ptsz` form instead of the function: when the function is implemented, that form must
    // be too (an alias, as a rule), or such a program gets CUDA_ERROR_NOT_SUPPORTED for a call
    // rgpu serves.
    for d in &decls {
        let n = d.name.to_string();
        let Some(base) = n.strip_suffix("_ptds").or_else(|| n.strip_suffix("_ptsz")) else { continue };
        if implemented.contains(base) && !implemented.contains(&n) && !alias_of.contains_key(&n) {
            return Err(syn::Error::new(
                Span::call_site(),
                format!("`{base}` is implemented but its per-thread form `{n}` is neither implemented nor an alias"),
            ));
        }
    }

    let path_str = path.to_string_lossy().into_owned();
    let mut fns = vec![];
    let mut arms = vec![];
    for d in &decls {
        let name = &d.name;
        let name_str = name.to_string();
        let arg_names: Vec<&Ident> = d.args.iter().map(|(n, _)| n).collect();
        let arg_types: Vec<&syn::Type> = d.args.iter().map(|(_, t)| t).collect();
        let output = &d.output;
        let runs = if implemented.contains(&name_str) { Some(name_str.clone()) } else { alias_of.get(&name_str).cloned() };
        let body = if let Some(target) = runs {
            let (module, function) = normalize(&target);
            let module = Ident::new(&module, Span::call_site());
            let function = Ident::new(&function, Span::call_site());
            // Each raw C argument is converted to the type the implementation declares
            // (`crate::entry::FromCuda`): `&mut T` for a required out-pointer (null is
            // CUDA_ERROR_INVALID_VALUE), `Option<&mut T>` for an optional one, the value itself
            // otherwise. The raw arguments are traced, lazily, before the conversion.
            quote! {
                crate::entry::call(
                    #name_str,
                    &[#(&#arg_names as &dyn ::std::fmt::Debug),*],
                    move || unsafe {
                        crate::r#impl::#module::#function(
                            #(crate::entry::FromCuda::from_cuda(#arg_names)?),*
                        )
                    },
                )
            }
        } else {
            quote! {
                static LOGGED: ::std::sync::atomic::AtomicBool =
                    ::std::sync::atomic::AtomicBool::new(false);
                crate::entry::unsupported(#name_str, &LOGGED)
            }
        };
        fns.push(quote! {
            #[cfg_attr(not(test), no_mangle)]
            #[allow(unused_variables)]
            pub unsafe extern "C" fn #name(#(#arg_names: #arg_types),*) #output {
                #body
            }
        });
        arms.push(quote! { #name_str => exports::#name as *mut ::std::ffi::c_void, });
    }

    Ok(quote! {
        // Rebuild when the declarations change.
        const _: &[u8] = include_bytes!(#path_str);

        /// Every CUDA driver API entry point this library exports (generated by
        /// `rgpu_shim_macros::cuda_entry_points!` from `src/cuda/functions.rs`).
        #[allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments, unused_unsafe)]
        pub mod exports {
            #[allow(unused_imports)]
            use crate::cuda::types::*;
            #(#fns)*
        }

        /// The address of the exported entry point with this exact symbol name.
        #[allow(dead_code)]
        pub(crate) fn symbol_address(name: &str) -> Option<*mut ::std::ffi::c_void> {
            Some(match name {
                #(#arms)*
                _ => return None,
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(name: &str) -> String {
        let (m, f) = normalize(name);
        format!("{m}::{f}")
    }

    #[test]
    fn examples_from_the_rule() {
        let cases = [
            ("cuMemAlloc_v2", "memory::alloc_v2"),
            ("cuMemcpyHtoD_v2", "memory::memcpy_htod_v2"),
            ("cuMemsetD8Async", "memory::memset_d8_async"),
            ("cuMemcpy2DAsync_v2", "memory::memcpy_2d_async_v2"),
            ("cuMemHostAlloc", "memory::host_alloc"),
            ("cuMemCreate", "vmm::create"),
            ("cuMemAllocManaged", "managed::alloc_managed"),
            ("cuMemPrefetchAsync_v2", "managed::prefetch_async_v2"),
            ("cuMemAddressReserve", "vmm::address_reserve"),
            ("cuMemGetAllocationGranularity", "vmm::get_allocation_granularity"),
            ("cuMemAllocHost_v2", "memory::alloc_host_v2"),
            ("cuMemcpy", "memory::memcpy"),
            ("cuMemcpyDtoHAsync_v2_ptsz", "memory::memcpy_dtoh_async_v2_ptsz"),
            ("cuMemsetD2D8_v2", "memory::memset_d2d8_v2"),
            ("cuMemsetD32_v2", "memory::memset_d32_v2"),
            ("cuMemcpy3DPeerAsync_ptsz", "memory::memcpy_3d_peer_async_ptsz"),
            ("cuCtxGetCurrent", "context::get_current"),
            ("cuDevicePrimaryCtxRetain", "primary_context::retain"),
            ("cuDeviceGet", "device::get"),
            ("cuDeviceGetPCIBusId", "device::get_pci_bus_id"),
            ("cuDeviceGetP2PAttribute", "device::get_p2p_attribute"),
            ("cuDeviceGetTexture1DLinearMaxWidth", "device::get_texture_1d_linear_max_width"),
            ("cuDeviceTotalMem_v2", "device::total_mem_v2"),
            ("cuStreamCreate", "stream::create"),
            ("cuStreamWaitValue32_v2", "stream::wait_value32_v2"),
            ("cuEventDestroy_v2", "event::destroy_v2"),
            ("cuLaunchKernel", "launch::kernel"),
            ("cuLaunch", "launch::launch"),
            ("cuInit", "driver::init"),
            ("cuGetErrorString", "driver::get_error_string"),
            ("cuGetProcAddress_v2", "driver::get_proc_address_v2"),
            ("cuGetExportTable", "driver::get_export_table"),
            ("cuGraphicsMapResources", "driver::graphics_map_resources"),
            ("cuGraphAddKernelNode_v2", "graph::add_kernel_node_v2"),
            ("cuArrayCreate_v2", "array::create_v2"),
            ("cuArray3DCreate_v2", "array::array_3d_create_v2"),
            ("cuTexRefCreate", "texture::tex_ref_create"),
            ("cuTexObjectCreate", "texture::tex_object_create"),
            ("cuSurfObjectCreate", "texture::surf_object_create"),
            ("cuModuleGetGlobal_v2", "module::get_global_v2"),
            ("cuLibraryLoadData", "library::load_data"),
            ("cuKernelGetFunction", "kernel::get_function"),
            ("cuFuncGetAttribute", "function::get_attribute"),
            ("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
             "occupancy::max_active_blocks_per_multiprocessor_with_flags"),
            ("cuPointerGetAttribute", "pointer::get_attribute"),
            ("cuLinkCreate_v2", "link::create_v2"),
            ("cuIpcOpenMemHandle_v2", "ipc::open_mem_handle_v2"),
            ("cuProfilerStart", "profiler::start"),
            ("cuGLMapBufferObject_v2_ptds", "driver::gl_map_buffer_object_v2_ptds"),
            ("cuVDPAUCtxCreate_v2", "driver::vdpau_ctx_create_v2"),
        ];
        for (name, want) in cases {
            assert_eq!(n(name), want, "{name}");
        }
    }

    /// Every declared function maps to a distinct, valid `module::function`.
    #[test]
    fn all_declarations_map_uniquely() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(FUNCTIONS_PATH);
        let text = std::fs::read_to_string(&path).expect("functions.rs");
        let decls = parse_declarations(&text).expect("parse");
        assert!(decls.len() > 600, "only {} declarations", decls.len());
        let mut seen = std::collections::BTreeMap::new();
        for d in &decls {
            let name = d.name.to_string();
            let (m, f) = normalize(&name);
            assert!(syn::parse_str::<Ident>(&f).is_ok(), "{name} -> {f} is not an identifier");
            if let Some(other) = seen.insert(format!("{m}::{f}"), name.clone()) {
                panic!("{name} and {other} both map to {m}::{f}");
            }
        }
    }
}
