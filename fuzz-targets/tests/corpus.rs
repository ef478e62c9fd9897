//! Every file of the committed seed corpus (`fuzz/corpus/TARGET/`), and
//! every input a fuzz run once crashed on (`fuzz/regressions/TARGET/`),
//! through its target's body: on stable, with `cargo test`.

use std::path::PathBuf;
use std::time::Instant;

fn dir(kind: &str, target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(kind)
        .join(target)
}

fn replay(kind: &str, min_files: usize) {
    for (name, run) in rgpu_fuzz_targets::TARGETS {
        let d = dir(kind, name);
        let mut files: Vec<PathBuf> = match std::fs::read_dir(&d) {
            Ok(rd) => rd
                .map(|e| e.unwrap().path())
                .filter(|p| p.is_file())
                .collect(),
            Err(_) if min_files == 0 => continue,
            Err(e) => panic!("{}: {e}", d.display()),
        };
        files.sort();
        assert!(
            files.len() >= min_files,
            "{}: {} files, want at least {min_files}",
            d.display(),
            files.len()
        );
        for f in &files {
            let bytes = std::fs::read(f).unwrap();
            let t = Instant::now();
            run(&bytes);
            let took = t.elapsed();
            // libFuzzer's -timeout is 10 s; a seed must be far quicker.
            assert!(took.as_secs() < 5, "{}: took {took:?}", f.display());
        }
        eprintln!("{name}: {} {kind} files", files.len());
    }
}

#[test]
fn the_seed_corpus_replays_cleanly() {
    replay("corpus", 10);
}

#[test]
fn every_past_crash_replays_cleanly() {
    replay("regressions", 0);
}
