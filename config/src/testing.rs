//! The check every daemon's settings must pass, for its unit tests.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Loaded, LoadError, Settings, CONFIG_FLAG};

/// Panics unless, for `S`:
///
/// - every long flag of `--help` (but `--help`, `--version` and `--config`)
///   is a setting, listed with its environment variable, that the TOML file
///   accepts as a key; and a key that is no setting is refused;
/// - for each setting, a flag beats the environment variable, which beats
///   the file, which beats the default.
///
/// `samples` gives, for each setting's key, two values that read as
/// different settings, at least one of them not the default; a setting
/// without samples fails the check, so a new flag cannot skip it.
pub fn check_every_setting<S: Settings>(samples: &[(&str, [&str; 2])]) {
    let help = S::command().render_long_help().to_string();
    let flags = long_flags(&help);
    let keys: HashMap<&str, &str> = S::keys().iter().copied().collect();
    assert_eq!(keys.len(), S::keys().len(), "{}: two settings share a key", S::NAME);
    let dir = scratch_dir(S::NAME);
    let check = Check::<S> { dir: &dir, files: AtomicU32::new(0), _s: std::marker::PhantomData };
    let mut seen = 0;
    for flag in &flags {
        if ["help", "version", CONFIG_FLAG].contains(&flag.as_str()) {
            continue;
        }
        seen += 1;
        let env = *keys.get(flag.as_str()).unwrap_or_else(|| panic!("{}: --{flag} is not a setting", S::NAME));
        assert!(help.contains(&format!("[env: {env}]")), "{}: --help does not name {env} for --{flag}", S::NAME);
        let [a, b] = samples
            .iter()
            .find(|(k, _)| k == flag)
            .unwrap_or_else(|| panic!("{}: no sample values for --{flag}", S::NAME))
            .1;
        check.setting(flag, env, a, b);
    }
    assert_eq!(seen, keys.len(), "{}: a setting is missing from --help (flags: {flags:?})", S::NAME);
    // Every key at once, as one file.
    let all: String = samples.iter().map(|(k, [a, _])| format!("{k} = {}\n", toml_string(a))).collect();
    check.load(&[], &HashMap::new(), Some(&all)).unwrap_or_else(|e| panic!("{}: a file with every key: {e}", S::NAME));
    match check.load(&[], &HashMap::new(), Some("no-such-setting = 1\n")) {
        Err(LoadError::UnknownKey { key, .. }) if key == "no-such-setting" => {}
        other => panic!("{}: an unknown key was not refused: {other:?}", S::NAME),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

struct Check<'a, S> {
    dir: &'a Path,
    files: AtomicU32,
    _s: std::marker::PhantomData<S>,
}

#[derive(Clone, Copy, Debug)]
enum Source {
    Flag,
    Env,
    File,
}

impl<S: Settings> Check<'_, S> {
    fn setting(&self, key: &str, env: &str, a: &str, b: &str) {
        let name = S::NAME;
        let value = |loaded: Result<Loaded<S>, LoadError>, what: &dyn std::fmt::Display| -> String {
            let l = loaded.unwrap_or_else(|e| panic!("{name}: --{key} {what}: {e}"));
            l.settings.value_debug(key).unwrap_or_else(|| panic!("{name}: --{key} is not a field"))
        };
        let default = S::default().value_debug(key).unwrap_or_else(|| panic!("{name}: --{key} is not a field"));
        assert_eq!(value(self.load(&[], &HashMap::new(), None), &"unset"), default, "{name}: --{key}: the default");
        // What each sample reads as, taken from the flag.
        let read = |v: &str| value(self.only(Source::Flag, key, env, v), &format_args!("= {v:?}"));
        let (va, vb) = (read(a), read(b));
        assert_ne!(va, vb, "{name}: --{key}: samples {a:?} and {b:?} read alike");
        let (x, vx) = if va != default { (a, &va) } else { (b, &vb) };
        assert_ne!(*vx, default, "{name}: --{key}: both samples read as the default");
        for source in [Source::Env, Source::File] {
            let got = value(self.only(source, key, env, x), &format_args!("from {source:?}"));
            assert_eq!(&got, vx, "{name}: --{key} = {x:?} from {source:?} alone");
        }
        // A TOML number or boolean as well as a string, where the sample is one.
        if let Ok(t) = format!("{key} = {x}").parse::<toml::Table>() {
            if !t[key].is_str() {
                let got = value(self.load(&[], &HashMap::new(), Some(&format!("{key} = {x}\n"))), &"bare in TOML");
                assert_eq!(&got, vx, "{name}: {key} = {x} in the file");
            }
        }
        for (hi, lo) in [(Source::Flag, Source::Env), (Source::Flag, Source::File), (Source::Env, Source::File)] {
            for (top, under, want) in [(a, b, &va), (b, a, &vb)] {
                let (args, envs, file) = self.sources(&[(hi, top), (lo, under)], key, env);
                let got = value(self.load(&args, &envs, file.as_deref()), &format_args!("{hi:?} {top:?} over {lo:?} {under:?}"));
                assert_eq!(&got, want, "{name}: --{key}: {hi:?} = {top:?} must beat {lo:?} = {under:?}");
            }
        }
    }

    fn only(&self, source: Source, key: &str, env: &str, v: &str) -> Result<Loaded<S>, LoadError> {
        let (args, envs, file) = self.sources(&[(source, v)], key, env);
        self.load(&args, &envs, file.as_deref())
    }

    fn sources(&self, set: &[(Source, &str)], key: &str, env: &str) -> (Vec<String>, HashMap<String, String>, Option<String>) {
        let (mut args, mut envs, mut file) = (Vec::new(), HashMap::new(), None);
        for (source, v) in set {
            match source {
                // `--key=value`: the one form both switches and valued flags take.
                Source::Flag => args.push(format!("--{key}={v}")),
                Source::Env => drop(envs.insert(env.to_string(), v.to_string())),
                Source::File => file = Some(format!("{key} = {}\n", toml_string(v))),
            }
        }
        (args, envs, file)
    }

    fn load(&self, args: &[String], env: &HashMap<String, String>, file: Option<&str>) -> Result<Loaded<S>, LoadError> {
        let mut argv: Vec<OsString> = vec![S::NAME.into()];
        argv.extend(args.iter().map(OsString::from));
        if let Some(text) = file {
            let n = self.files.fetch_add(1, Ordering::Relaxed);
            let path = self.dir.join(format!("{n}.toml"));
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
            argv.push(format!("--{CONFIG_FLAG}").into());
            argv.push(path.into());
        }
        S::load_from(argv, env)
    }
}

/// The long flags `--help` shows, in order.
fn long_flags(help: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for line in help.lines() {
        let l = line.trim_start();
        // Flags are indented less than their help text (clap: 2 or 6
        // spaces, help 10), so a wrapped help line naming a flag is no flag.
        if line.len() - l.len() >= 8 {
            continue;
        }
        // "-h, --help": a short flag first.
        let l = match l.as_bytes() {
            [b'-', c, b',', b' ', ..] if *c != b'-' => &l[4..],
            _ => l,
        };
        let Some(rest) = l.strip_prefix("--") else { continue };
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        if !name.is_empty() && !flags.contains(&name) {
            flags.push(name);
        }
    }
    flags
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn scratch_dir(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "rgpu-config-check-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_flags_of_help() {
        let help = "Usage: x [OPTIONS]\n\nOptions:\n      --listen <ADDR>\n          Address, see\n          --other [env: X]\n      --fast[=<BOOL>]\n  -h, --help\n          Print help\n";
        assert_eq!(super::long_flags(help), vec!["listen", "fast", "help"]);
    }
}
