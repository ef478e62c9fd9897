//! Module images produced by nvcc 13.5 (see tests/fixtures/make.sh) read back as expected.

use std::path::PathBuf;

use rgpu_server::module::{read_image, read_image_for, GlobalSpace, ImageError, KernelInfo, ModuleImage};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load(name: &str) -> Vec<u8> {
    std::fs::read(fixture_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn read(name: &str) -> ModuleImage {
    read_image(&load(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// (offset, size, align) of each parameter.
fn layout(k: &KernelInfo) -> Vec<(u32, u32, u32)> {
    k.params
        .iter()
        .map(|p| (p.offset, p.size, p.align))
        .collect()
}

/// (offset, size) of each parameter.
fn offsets(k: &KernelInfo) -> Vec<(u32, u32)> {
    k.params.iter().map(|p| (p.offset, p.size)).collect()
}

fn kernel<'a>(m: &'a ModuleImage, name: &str) -> &'a KernelInfo {
    m.kernels
        .iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("no kernel {name}"))
}

/// (offset, size, align) of each parameter of a kernel.
type Layout = Vec<(u32, u32, u32)>;

/// The layouts the x86-64/CUDA C ABI gives the kernels of params.cu.
fn expected_params() -> Vec<(&'static str, Layout)> {
    let i = |o| (o, 4, 4);
    let p = |o| (o, 8, 8);
    vec![
        ("k_ints", vec![i(0), i(4), p(8), p(16)]),
        (
            "k_mixed",
            vec![(0, 1, 1), (2, 2, 2), i(4), p(8), p(16), (24, 1, 1)],
        ),
        // S8 {char; double; int} = 24/8, char, S16 = 32/16, Arr {short[3]; char; int[5]} = 28/4,
        // Tiny {char; char} = 2/1, float*.
        (
            "k_structs",
            vec![
                (0, 24, 8),
                (24, 1, 1),
                (32, 32, 16),
                (64, 28, 4),
                (92, 2, 1),
                p(96),
            ],
        ),
        (
            "_Z6k_manyiiiiiiiidcdcfsPvPKfhiiiiiiiPi",
            vec![
                i(0),
                i(4),
                i(8),
                i(12),
                i(16),
                i(20),
                i(24),
                i(28), // a0..a7
                p(32),
                (40, 1, 1),
                p(48),
                (56, 1, 1),
                i(60),
                (64, 2, 2), // d0 c0 d1 c1 f0 s0
                p(72),
                p(80),
                (88, 1, 1), // p0 p1 u8
                i(92),
                i(96),
                i(100),
                i(104),
                i(108),
                i(112),
                i(116),
                p(120), // a8..a14 out
            ],
        ),
        ("_Z6k_tmplIfEvPT_PKS0_S0_i", vec![p(0), p(8), i(16), i(20)]),
        ("_Z6k_tmplIdEvPT_PKS0_S0_i", vec![p(0), p(8), p(16), i(24)]),
        ("k_bounds", vec![p(0)]),
        ("k_noparams", vec![]),
    ]
}

#[test]
fn every_fixture_parses_or_is_refused_clearly() {
    let mut n = 0;
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !(name.ends_with(".fatbin") || name.ends_with(".cubin") || name.ends_with(".ptx")) {
            continue;
        }
        n += 1;
        let r = read_image(&std::fs::read(&path).unwrap());
        if name.starts_with("ptrinit.") {
            let e = r.expect_err(&name).to_string();
            assert!(e.contains("g_ptr") || e.contains("generic"), "{name}: {e}");
            assert!(e.contains("unsupported"), "{name}: {e}");
        } else {
            let m = r.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!m.kernels.is_empty(), "{name}");
        }
    }
    assert!(n >= 24, "only {n} fixtures found");
}

#[test]
fn param_layouts_match_the_c_abi_in_every_format() {
    let ptx_sources = [
        "params.ptx",
        "params.default.fatbin",
        "params.compress-all.fatbin",
        "params.none.fatbin",
        "params.speed.fatbin",
        "params.size.fatbin",
        "params.multi.fatbin",
        "params.ptx-only.fatbin",
    ];
    for f in ptx_sources {
        let m = read(f);
        assert!(m.ptx.is_some(), "{f}");
        assert_eq!(m.kernels.len(), expected_params().len(), "{f}");
        for (name, want) in expected_params() {
            assert_eq!(layout(kernel(&m, name)), want, "{f}: {name}");
        }
    }
    // Cubins carry no parameter alignment; offsets and sizes must agree.
    for f in [
        "params.sm_75.cubin",
        "params.sm_90.cubin",
        "params.sass-only.fatbin",
    ] {
        let m = read(f);
        assert_eq!(m.ptx, None, "{f}");
        assert_eq!(m.kernels.len(), expected_params().len(), "{f}");
        for (name, want) in expected_params() {
            let k = kernel(&m, name);
            let want: Vec<(u32, u32)> = want.iter().map(|&(o, s, _)| (o, s)).collect();
            assert_eq!(offsets(k), want, "{f}: {name}");
            for p in &k.params {
                assert!(
                    p.align.is_power_of_two() && p.offset % p.align == 0,
                    "{f}: {name}"
                );
            }
            assert!(k.num_regs.is_some(), "{f}: {name}");
        }
    }
}

#[test]
fn kernel_attributes() {
    let ptx = read("params.default.fatbin");
    let k = kernel(&ptx, "k_bounds");
    assert_eq!(k.max_threads_per_block, Some(256));
    assert_eq!(k.shared_static_bytes, 1024 + 16);
    assert!(
        k.num_regs.is_some(),
        "register count merged from the sm_75 SASS"
    );
    assert_eq!(kernel(&ptx, "k_ints").max_threads_per_block, None);
    assert_eq!(kernel(&ptx, "k_ints").shared_static_bytes, 0);
    assert_eq!(kernel(&ptx, "k_structs").params_size(), 104);

    let sm75 = read("params.sm_75.cubin");
    let k = kernel(&sm75, "k_bounds");
    assert_eq!(k.max_threads_per_block, Some(256));
    assert_eq!(k.shared_static_bytes, 1040);
    // Register counts agree between the merged fatbin view and the bare cubin.
    for k in &sm75.kernels {
        assert_eq!(kernel(&ptx, &k.name).num_regs, k.num_regs, "{}", k.name);
    }
}

#[test]
fn compression_modes_give_the_same_module() {
    for src in ["params", "globals"] {
        let base = read(&format!("{src}.none.fatbin"));
        assert_eq!(base.sass_archs, vec![75]);
        for mode in ["default", "compress-all", "speed", "size"] {
            let m = read(&format!("{src}.{mode}.fatbin"));
            assert_eq!(m, base, "{src}.{mode}");
        }
    }
}

#[test]
fn ptx_choice_and_sass_archs() {
    let m = read("params.multi.fatbin");
    assert_eq!(m.sass_archs, vec![75, 90]);
    assert!(m.ptx.as_deref().unwrap().contains(".target sm_90"));

    let m = read("params.ptx-only.fatbin");
    assert!(m.sass_archs.is_empty());
    assert!(m.ptx.as_deref().unwrap().contains(".target sm_80"));
    assert!(m.kernels.iter().all(|k| k.num_regs.is_none()));

    let m = read("params.sass-only.fatbin");
    assert_eq!(
        (m.ptx.as_deref(), m.sass_archs.as_slice()),
        (None, &[90][..])
    );

    assert_eq!(read("params.sm_75.cubin").sass_archs, vec![75]);
    assert_eq!(read("params.sm_90.cubin").sass_archs, vec![90]);

    // Bare PTX, with and without the terminating NUL.
    let mut text = load("params.ptx");
    let a = read_image(&text).unwrap();
    text.push(0);
    text.extend_from_slice(b"garbage after the NUL");
    let b = read_image(&text).unwrap();
    assert_eq!(a, b);
    assert!(!a.ptx.as_deref().unwrap().contains('\0'));
}

/// PTX is chosen as a driver chooses for the device: the newest not newer than it. PTX only for
/// newer devices is never chosen: with SASS beside it the module loads without PTX (the sim then
/// refuses its launches, saying why), without it the load fails (CUDA_ERROR_NO_BINARY_FOR_GPU).
/// Regression: the newest PTX was taken whatever the device (CuPy's compute_120 CUB kernels ran
/// on a 9.0 sim with sm_90 tuning and summed short).
#[test]
fn ptx_is_chosen_for_the_device() {
    let multi = load("params.multi.fatbin"); // sm_75 + compute_75, sm_90 + compute_90
    let m = read_image_for(&multi, 90).unwrap();
    assert_eq!((m.ptx_arch, m.newer_ptx), (Some(90), None));
    let m = read_image_for(&multi, 86).unwrap();
    assert_eq!((m.ptx_arch, m.newer_ptx), (Some(75), None));
    assert!(m.ptx.as_deref().unwrap().contains(".target sm_75"));
    let m = read_image_for(&multi, 120).unwrap();
    assert_eq!(m.ptx_arch, Some(90), "newer devices run the newest PTX");
    // On 7.0 neither the sm_75/sm_90 SASS nor the compute_75/90 PTX may run.
    assert!(matches!(read_image_for(&multi, 70), Err(ImageError::NoCompatibleCode { ptx: Some(75), arch: 70, .. })));

    // SASS for the device and PTX only for newer ones: loads, with no PTX to run, saying why.
    let sass_only = load("params.sass-only.fatbin"); // sm_90
    let m = read_image_for(&sass_only, 90).unwrap();
    assert_eq!((m.ptx.is_none(), m.newer_ptx), (true, None));
    assert!(!m.kernels.is_empty(), "the SASS describes the module");
    assert!(read_image_for(&sass_only, 89).is_err(), "sm_90 SASS does not run on 8.9");
    assert!(read_image_for(&sass_only, 100).is_err(), "sm_90 SASS does not run on 10.0");

    let ptx_only = load("params.ptx-only.fatbin"); // compute_80
    assert_eq!(read_image_for(&ptx_only, 80).unwrap().ptx_arch, Some(80));
    assert!(matches!(read_image_for(&ptx_only, 75), Err(ImageError::NoBinaryForGpu { ptx: 80, arch: 75 })));

    let text = load("params.ptx"); // .target sm_75
    assert_eq!(read_image_for(&text, 90).unwrap().ptx_arch, Some(75));
    assert!(matches!(read_image_for(&text, 70), Err(ImageError::PtxTargetTooNew { target: 75, arch: 70 })));
}

fn le<T: Copy, const N: usize>(vals: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    vals.iter().flat_map(|&v| f(v)).collect()
}

#[test]
fn globals_read_back() {
    use GlobalSpace::{Const, Global};
    let mut pair = 3i32.to_le_bytes().to_vec();
    pair.extend_from_slice(&[0; 4]);
    pair.extend_from_slice(&6.5f64.to_le_bytes());
    type Want = (&'static str, u64, u32, GlobalSpace, Option<Vec<u8>>);
    let want: Vec<Want> = vec![
        ("g_int", 4, 4, Global, Some(42i32.to_le_bytes().to_vec())),
        ("g_zero", 4, 4, Global, None),
        ("g_float", 4, 4, Global, Some(1.5f32.to_le_bytes().to_vec())),
        (
            "g_double",
            8,
            8,
            Global,
            Some((-2.25f64).to_le_bytes().to_vec()),
        ),
        ("g_char", 1, 1, Global, Some(vec![b'A'])),
        (
            "g_short",
            2,
            2,
            Global,
            Some((-7i16).to_le_bytes().to_vec()),
        ),
        (
            "g_i64",
            8,
            8,
            Global,
            Some(0x1122334455667788i64.to_le_bytes().to_vec()),
        ),
        (
            "g_arr",
            20,
            4,
            Global,
            Some(le(&[1i32, 2, 3, 4, 5], i32::to_le_bytes)),
        ),
        (
            "g_farr",
            16,
            4,
            Global,
            Some(le(&[0.5f32, 1.0, 2.0, 4.0], f32::to_le_bytes)),
        ),
        (
            "g_bytes",
            7,
            1,
            Global,
            Some(vec![1, 2, 3, 250, 251, 252, 253]),
        ),
        ("g_big_zero", 8000, 8, Global, None),
        (
            "g_partial",
            24,
            4,
            Global,
            Some(le(&[9i32, 8, 0, 0, 0, 0], i32::to_le_bytes)),
        ),
        ("g_pair", 16, 8, Global, Some(pair)),
        (
            "c_coef",
            32,
            4,
            Const,
            Some(le(&[1f32, 2., 3., 4., 5., 6., 7., 8.], f32::to_le_bytes)),
        ),
        ("c_uninit", 64, 4, Const, None),
        ("c_one", 4, 4, Const, Some(7i32.to_le_bytes().to_vec())),
    ];
    // Initial bytes may stop short of the variable (the rest is zero).
    let padded = |g: &rgpu_server::module::GlobalInfo| {
        g.init.clone().map(|mut v| {
            assert!(v.len() as u64 <= g.size);
            v.resize(g.size as usize, 0);
            v
        })
    };
    let sorted = |m: &ModuleImage| {
        let mut g: Vec<_> = m
            .globals
            .iter()
            .map(|g| (g.name.clone(), g.size, g.space, padded(g)))
            .collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        g
    };
    let mut want_sorted: Vec<_> = want
        .iter()
        .map(|(n, s, _, sp, i)| (n.to_string(), *s, *sp, i.clone()))
        .collect();
    want_sorted.sort_by(|a, b| a.0.cmp(&b.0));

    // PTX (and fatbins, which use their PTX): exact, alignment included, in source order.
    for f in [
        "globals.ptx",
        "globals.default.fatbin",
        "globals.compress-all.fatbin",
        "globals.multi.fatbin",
    ] {
        let m = read(f);
        let got: Vec<_> = m
            .globals
            .iter()
            .map(|g| (g.name.as_str(), g.size, g.align, g.space, padded(g)))
            .collect();
        assert_eq!(got, want, "{f}");
    }
    // Cubins: same variables and bytes; alignment is inferred, so only sanity-checked.
    for f in [
        "globals.sm_75.cubin",
        "globals.sm_90.cubin",
        "globals.sass-only.fatbin",
    ] {
        let m = read(f);
        assert_eq!(sorted(&m), want_sorted, "{f}");
        for g in &m.globals {
            let ptx_align = want.iter().find(|w| w.0 == g.name).map(|w| w.2).unwrap();
            assert!(
                g.align >= ptx_align && g.align <= 16,
                "{f}: {} align {}",
                g.name,
                g.align
            );
        }
    }
}

#[test]
fn clear_errors() {
    assert!(matches!(read_image(&[]), Err(ImageError::Empty)));
    let wrapper = [0xB1, 0x43, 0x62, 0x46, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    assert!(matches!(
        read_image(&wrapper),
        Err(ImageError::FatbinWrapper)
    ));
    assert!(matches!(
        read_image(&[1, 2, 3, 4, 5]),
        Err(ImageError::UnknownFormat { .. })
    ));
    // An empty fatbin container (what the device-link step leaves in every executable).
    let empty = [0x50, 0xED, 0x55, 0xBA, 1, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    assert!(matches!(read_image(&empty), Err(ImageError::NoEntries)));

    let e = read_image(&load("ptrinit.ptx")).unwrap_err();
    assert!(
        matches!(e, ImageError::PtxUnsupported { line, .. } if line > 10),
        "{e}"
    );
    let e = read_image(&load("ptrinit.sm_90.cubin")).unwrap_err();
    assert!(
        matches!(&e, ImageError::Unsupported(m) if m.contains("g_ptr")),
        "{e}"
    );
    let e = read_image(&load("ptrinit.default.fatbin")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("fatbin entry 1 (PTX compute_75): PTX line"),
        "{e}"
    );

    // An unknown compression method (both flags) is named.
    let mut f = load("params.default.fatbin");
    let ptx_entry = 16 + 64 + 14816; // container header + ELF entry (see make.sh output)
    f[ptx_entry + 41] |= 0x20; // flags 0x8011 -> 0xa011: LZ4 and zstd at once
    let e = read_image(&f).unwrap_err().to_string();
    assert!(e.contains("unsupported compression"), "{e}");
}

#[test]
fn every_prefix_of_a_binary_is_an_error() {
    for f in [
        "params.ptx-only.fatbin",
        "globals.compress-all.fatbin",
        "globals.speed.fatbin",
        "globals.sm_75.cubin",
    ] {
        let bytes = load(f);
        for n in 0..bytes.len() {
            assert!(
                read_image(&bytes[..n]).is_err(),
                "{f}: prefix of {n} bytes was accepted"
            );
        }
    }
    // PTX prefixes may be valid PTX; they just must not panic.
    let text = load("globals.ptx");
    for n in 0..text.len() {
        let _ = read_image(&text[..n]);
    }
}

/// xorshift64*, to keep the test deterministic without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
}

#[test]
fn random_corruption_never_panics() {
    let mut rng = Rng(0x9E3779B97F4A7C15);
    for f in [
        "params.none.fatbin",
        "globals.compress-all.fatbin",
        "globals.speed.fatbin",
        "globals.sm_90.cubin",
        "params.sm_75.cubin",
        "globals.ptx",
    ] {
        let orig = load(f);
        for _ in 0..1500 {
            let mut b = orig.clone();
            let flips = 1 + rng.next() % 4;
            for _ in 0..flips {
                let at = (rng.next() % b.len() as u64) as usize;
                // Mostly headers: the first 200 bytes get half of the hits.
                let at = if rng.next() & 1 == 0 {
                    at % 200.min(b.len())
                } else {
                    at
                };
                b[at] ^= 1 << (rng.next() % 8);
            }
            let _ = read_image(&b);
        }
    }
}
