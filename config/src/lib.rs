//! Settings declared once for their three sources.
//!
//! rgpu's daemons (`rgpu-server`, `rgpu-broker`) take each setting from a
//! command-line flag, an environment variable, or a TOML file (`--config`,
//! keys as the long flags), in that order of precedence, then a default.
//! [`settings!`] declares each setting once (type, flag, environment
//! variable, default, help) and derives all three from that one line, so a
//! flag cannot exist that the file refuses, or the reverse.
//!
//! Values are text to one parser per setting ([`FromText`], or `parse =`):
//! a TOML value is read as the text a flag would carry (`sim-memory =
//! "8GiB"` or `sim-memory = 8589934592`, `rdma-zero-copy = true`), so the
//! sources accept the same values. The environment is read through [`Env`]
//! rather than by clap, so that tests can pass a map instead of mutating
//! the process environment.
//!
//! [`testing::check_every_setting`] is the test each daemon runs: every
//! flag of `--help` is a TOML key, and flag > env > file > default holds for
//! each setting.

mod bandwidth;
mod size;
mod text;
pub mod testing;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

pub use bandwidth::{format_bandwidth, parse_bandwidth};
pub use size::parse_size;
pub use text::{toml_text, via_from_str, FromText};

#[doc(hidden)]
pub use clap;

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

/// The flag naming the TOML file; it is not itself a key of the file.
pub const CONFIG_FLAG: &str = "config";

/// Where environment variables come from. An empty variable counts as
/// unset, so `RGPU_SERVER_BROKER= rgpu-server` means no broker.
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        // A value that is not UTF-8 is passed on mangled: its parser then
        // says what is wrong with it rather than the variable being ignored.
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()).filter(|v| !v.is_empty())
    }
}

impl Env for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).filter(|v| !v.is_empty()).cloned()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Bad flags, or `--help` / `--version`: [`LoadError::exit`] prints it
    /// as clap does.
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("environment variable {var}={value:?}: {reason}")]
    Env { var: &'static str, value: String, reason: String },
    #[error("cannot read config file {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {}: {reason}", path.display())]
    Syntax { path: PathBuf, reason: String },
    #[error("config file {}: unknown key `{key}` (the keys are the long flags: {known})", path.display())]
    UnknownKey { path: PathBuf, key: String, known: String },
    #[error("config file {}: {key}: {reason}", path.display())]
    Value { path: PathBuf, key: String, reason: String },
}

impl LoadError {
    /// Ends the process the way a command-line tool should: help and
    /// version on stdout with status 0, usage errors as clap prints them,
    /// anything else as `error: ...` with status 2.
    pub fn exit(self) -> ! {
        match self {
            LoadError::Cli(e) => e.exit(),
            other => {
                eprintln!("error: {other}");
                std::process::exit(2)
            }
        }
    }
}

/// A settings struct made by [`settings!`].
pub trait Settings: Sized + Default + std::fmt::Debug {
    /// The program name, as `--help` shows it.
    const NAME: &'static str;
    /// The environment variable that names the TOML file (as `--config`).
    const CONFIG_ENV: &'static str;
    /// Top-level tables the file may hold besides the settings (the
    /// broker's `[tenants.*]`); they come back in [`Loaded::tables`].
    const FILE_TABLES: &'static [&'static str];

    /// Each setting's TOML key (its long flag) and environment variable.
    fn keys() -> &'static [(&'static str, &'static str)];
    /// The command line, with `--config` and every setting.
    fn command() -> Command;
    /// Each setting from the highest source that has it, else its default.
    fn resolve(layers: &Layers<'_>) -> Result<Self, LoadError>;
    /// The setting named by `key`, `Debug`-formatted (for tests).
    fn value_debug(&self, key: &str) -> Option<String>;

    /// Reads the settings from `args` (the program name first), `env` and
    /// the file `--config` (or [`Settings::CONFIG_ENV`]) names.
    fn load_from<I, A>(args: I, env: &dyn Env) -> Result<Loaded<Self>, LoadError>
    where
        I: IntoIterator<Item = A>,
        A: Into<OsString> + Clone,
    {
        load(args, env)
    }

    /// [`Settings::load_from`] the process's arguments and environment.
    fn from_process() -> Result<Loaded<Self>, LoadError> {
        load(std::env::args_os(), &ProcessEnv)
    }
}

/// The settings, and what else the file held.
#[derive(Debug)]
pub struct Loaded<S> {
    pub settings: S,
    /// The TOML file read, if any.
    pub file: Option<PathBuf>,
    /// The file's tables named in [`Settings::FILE_TABLES`] (others are
    /// refused while loading), for the program to read with serde.
    pub tables: toml::Table,
}

/// The three sources, for [`Settings::resolve`].
pub struct Layers<'a> {
    matches: ArgMatches,
    env: &'a dyn Env,
    file: Option<(PathBuf, toml::Table)>,
}

impl Layers<'_> {
    /// One setting: the flag if given, else the environment variable, else
    /// the file's key; `None` if none has it.
    pub fn get<T: Clone + Send + Sync + 'static>(
        &self,
        key: &'static str,
        env: &'static str,
        parse: fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, LoadError> {
        if self.matches.value_source(key) == Some(ValueSource::CommandLine) {
            // Parsed by clap with the same `parse` (see `arg`).
            return Ok(self.matches.get_one::<T>(key).cloned());
        }
        if let Some(value) = self.env.var(env) {
            return match parse(&value) {
                Ok(v) => Ok(Some(v)),
                Err(reason) => Err(LoadError::Env { var: env, value, reason }),
            };
        }
        if let Some((path, table)) = &self.file {
            if let Some(v) = table.get(key) {
                let err = |reason| LoadError::Value { path: path.clone(), key: key.to_string(), reason };
                let text = toml_text(v).map_err(err)?;
                return parse(&text).map(Some).map_err(err);
            }
        }
        Ok(None)
    }
}

fn load<S: Settings, I, A>(args: I, env: &dyn Env) -> Result<Loaded<S>, LoadError>
where
    I: IntoIterator<Item = A>,
    A: Into<OsString> + Clone,
{
    let matches = S::command().try_get_matches_from(args)?;
    let path = matches.get_one::<PathBuf>(CONFIG_FLAG).cloned().or_else(|| env.var(S::CONFIG_ENV).map(PathBuf::from));
    let (file, tables) = match &path {
        Some(p) => {
            let (settings, tables) = read_file(p, S::keys(), S::FILE_TABLES)?;
            (Some((p.clone(), settings)), tables)
        }
        None => (None, toml::Table::new()),
    };
    let settings = S::resolve(&Layers { matches, env, file })?;
    Ok(Loaded { settings, file: path, tables })
}

/// Splits the file into settings and the extra tables, refusing any other
/// key: a typo must not silently leave a setting at its default.
fn read_file(
    path: &Path,
    keys: &[(&str, &str)],
    tables: &[&str],
) -> Result<(toml::Table, toml::Table), LoadError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| LoadError::Read { path: path.to_path_buf(), source })?;
    let all: toml::Table =
        text.parse().map_err(|e: toml::de::Error| LoadError::Syntax { path: path.to_path_buf(), reason: e.to_string() })?;
    let (mut settings, mut extra) = (toml::Table::new(), toml::Table::new());
    for (k, v) in all {
        if keys.iter().any(|(key, _)| *key == k) {
            settings.insert(k, v);
        } else if tables.contains(&k.as_str()) {
            extra.insert(k, v);
        } else {
            let mut known: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
            known.extend(tables.iter().copied());
            return Err(LoadError::UnknownKey { path: path.to_path_buf(), key: k, known: known.join(", ") });
        }
    }
    Ok((settings, extra))
}

/// The command without its settings: name, version, about.
#[doc(hidden)]
pub fn command(name: &'static str, version: &'static str, about: &[&str]) -> Command {
    Command::new(name).version(version).about(join_doc(about))
}

/// `--config`, after the settings: its help says "the settings above".
#[doc(hidden)]
pub fn config_arg(config_env: &'static str, config_help: &str) -> Arg {
    Arg::new(CONFIG_FLAG)
        .long(CONFIG_FLAG)
        .value_name("FILE")
        .value_parser(clap::value_parser!(PathBuf))
        .action(ArgAction::Set)
        .help(format!("{config_help} [env: {config_env}]"))
}

/// One setting's flag. Booleans take an optional `=BOOL`, so that a flag
/// can also turn off what the environment or the file turned on.
#[doc(hidden)]
pub fn arg<T: Clone + Send + Sync + 'static>(
    key: &'static str,
    env: &'static str,
    doc: &[&str],
    value_name: Option<&'static str>,
    parse: fn(&str) -> Result<T, String>,
) -> Arg {
    let arg = Arg::new(key)
        .long(key)
        .action(ArgAction::Set)
        .value_parser(parse)
        .help(format!("{} [env: {env}]", join_doc(doc)));
    let arg = if std::any::TypeId::of::<T>() == std::any::TypeId::of::<bool>() {
        arg.num_args(0..=1).require_equals(true).default_missing_value("true").value_name("BOOL")
    } else {
        arg.num_args(1)
    };
    match value_name {
        Some(v) => arg.value_name(v),
        None => arg,
    }
}

/// Doc comment lines as one paragraph.
fn join_doc(lines: &[&str]) -> String {
    lines.iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// Declares a settings struct: each field is a setting, with its flag
/// (also its TOML key), environment variable, default and help (the doc
/// comment), optionally a `value_name` and a `parse` function (`fn(&str)
/// -> Result<T, String>`; otherwise the type's [`FromText`]). A setting
/// without a default is an `Option`.
///
/// ```
/// rgpu_config::settings! {
///     /// An example daemon.
///     #[settings(name = "exampled", config_env = "EXAMPLED_CONFIG",
///                config_help = "TOML file with any of the settings above")]
///     pub struct Settings {
///         /// Address to listen on.
///         #[setting(flag = "listen", env = "EXAMPLED_LISTEN", value_name = "ADDR")]
///         listen: String = "127.0.0.1:1".into(),
///         /// Memory to use.
///         #[setting(flag = "memory", env = "EXAMPLED_MEMORY", parse = rgpu_config::parse_size)]
///         memory: u64 = 1 << 30,
///         /// Where to report to.
///         #[setting(flag = "report-to", env = "EXAMPLED_REPORT_TO")]
///         report_to: Option<String> = None,
///     }
/// }
/// use rgpu_config::Settings as _;
/// let env = std::collections::HashMap::from([("EXAMPLED_MEMORY".to_string(), "2GiB".to_string())]);
/// let s = Settings::load_from(["exampled", "--listen", "0.0.0.0:2"], &env).unwrap().settings;
/// assert_eq!((s.listen.as_str(), s.memory, s.report_to), ("0.0.0.0:2", 2 << 30, None));
/// ```
#[macro_export]
macro_rules! settings {
    (
        $(#[doc = $sdoc:literal])*
        #[settings(name = $name:literal, config_env = $cenv:literal, config_help = $chelp:literal
                   $(, file_tables = [$($table:literal),* $(,)?])? $(,)?)]
        $vis:vis struct $ty:ident {
            $(
                $(#[doc = $doc:literal])*
                #[setting(flag = $flag:literal, env = $env:literal
                          $(, value_name = $vn:literal)? $(, parse = $parse:path)? $(,)?)]
                $field:ident : $fty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone)]
        $vis struct $ty {
            $( $(#[doc = $doc])* pub $field: $fty, )*
        }

        impl ::core::default::Default for $ty {
            fn default() -> Self {
                $ty { $( $field: $default, )* }
            }
        }

        impl $crate::Settings for $ty {
            const NAME: &'static str = $name;
            const CONFIG_ENV: &'static str = $cenv;
            const FILE_TABLES: &'static [&'static str] = &[$($($table),*)?];

            fn keys() -> &'static [(&'static str, &'static str)] {
                &[$(($flag, $env)),*]
            }

            fn command() -> $crate::clap::Command {
                $crate::command($name, env!("CARGO_PKG_VERSION"), &[$($sdoc),*])
                $(
                    .arg($crate::arg::<$fty>(
                        $flag, $env, &[$($doc),*],
                        $crate::__value_name!($($vn)?),
                        $crate::__parser!($fty $(, $parse)?),
                    ))
                )*
                .arg($crate::config_arg($cenv, $chelp))
            }

            fn resolve(layers: &$crate::Layers<'_>) -> ::core::result::Result<Self, $crate::LoadError> {
                Ok($ty {
                    $(
                        $field: match layers.get::<$fty>($flag, $env, $crate::__parser!($fty $(, $parse)?))? {
                            Some(v) => v,
                            None => $default,
                        },
                    )*
                })
            }

            fn value_debug(&self, key: &str) -> Option<String> {
                $( if key == $flag { return Some(format!("{:?}", self.$field)); } )*
                None
            }
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __value_name {
    () => {
        None
    };
    ($vn:literal) => {
        Some($vn)
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __parser {
    ($t:ty) => {{
        let p: fn(&str) -> ::core::result::Result<$t, String> = <$t as $crate::FromText>::from_text;
        p
    }};
    ($t:ty, $parse:path) => {{
        let p: fn(&str) -> ::core::result::Result<$t, String> = $parse;
        p
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    settings! {
        /// A test daemon.
        #[settings(name = "testd", config_env = "TESTD_CONFIG", config_help = "TOML file",
                   file_tables = ["extra"])]
        pub struct Test {
            /// Address.
            #[setting(flag = "listen", env = "TESTD_LISTEN", value_name = "ADDR")]
            listen: String = "here".into(),
            /// Memory.
            #[setting(flag = "memory", env = "TESTD_MEMORY", parse = crate::parse_size)]
            memory: u64 = 1 << 20,
            /// Count, optional.
            #[setting(flag = "count", env = "TESTD_COUNT")]
            count: Option<u16> = None,
            /// A switch.
            #[setting(flag = "fast", env = "TESTD_FAST")]
            fast: bool = false,
            /// A list.
            #[setting(flag = "names", env = "TESTD_NAMES")]
            names: Vec<String> = vec!["default".into()],
        }
    }

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rgpu-config-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn every_setting_passes_the_common_check() {
        testing::check_every_setting::<Test>(&[
            ("listen", ["a:1", "b:2"]),
            ("memory", ["1.5GiB", "4096"]),
            ("count", ["3", "4"]),
            ("fast", ["true", "false"]),
            ("names", ["a,b", "c"]),
        ]);
    }

    #[test]
    #[should_panic(expected = "no sample values for --names")]
    fn the_common_check_wants_samples_for_every_setting() {
        testing::check_every_setting::<Test>(&[
            ("listen", ["a:1", "b:2"]),
            ("memory", ["1.5GiB", "4096"]),
            ("count", ["3", "4"]),
            ("fast", ["true", "false"]),
        ]);
    }

    #[test]
    #[should_panic(expected = "read alike")]
    fn the_common_check_wants_samples_that_differ() {
        testing::check_every_setting::<Test>(&[
            ("listen", ["a:1", "b:2"]),
            ("memory", ["1KiB", "1024"]),
            ("count", ["3", "4"]),
            ("fast", ["true", "false"]),
            ("names", ["a,b", "c"]),
        ]);
    }

    #[test]
    fn sources_and_defaults() {
        let s = Test::load_from(["testd"], &env(&[])).unwrap().settings;
        assert_eq!((s.listen.as_str(), s.memory, s.count, s.fast), ("here", 1 << 20, None, false));
        let p = temp_file("sources", "memory = 8589934592\nfast = true\nnames = [\"x\", \"y\"]\n[extra.t]\nk = 1\n");
        let l = Test::load_from(["testd"], &env(&[("TESTD_CONFIG", p.to_str().unwrap()), ("TESTD_COUNT", "9")])).unwrap();
        assert_eq!(l.file.as_deref(), Some(p.as_path()));
        let s = l.settings;
        assert_eq!((s.memory, s.count, s.fast, s.names), (8 << 30, Some(9), true, vec!["x".to_string(), "y".into()]));
        assert_eq!(l.tables["extra"]["t"]["k"].as_integer(), Some(1));
        // `--fast=false` overrides the file's `fast = true`.
        let s = Test::load_from(["testd", "--config", p.to_str().unwrap(), "--fast=false"], &env(&[])).unwrap().settings;
        assert!(!s.fast);
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }

    #[test]
    fn errors_name_their_source() {
        let e = Test::load_from(["testd"], &env(&[("TESTD_MEMORY", "lots")])).unwrap_err();
        assert!(matches!(e, LoadError::Env { var: "TESTD_MEMORY", .. }), "{e}");
        assert!(e.to_string().contains("lots"), "{e}");
        let e = Test::load_from(["testd", "--memory", "lots"], &env(&[])).unwrap_err();
        assert!(matches!(e, LoadError::Cli(_)), "{e}");
        let p = temp_file("errors", "memory = \"lots\"\n");
        let e = Test::load_from(["testd", "--config", p.to_str().unwrap()], &env(&[])).unwrap_err();
        assert!(matches!(&e, LoadError::Value { key, .. } if key == "memory"), "{e}");
        std::fs::write(&p, "memroy = 1\n").unwrap();
        let e = Test::load_from(["testd", "--config", p.to_str().unwrap()], &env(&[])).unwrap_err();
        assert!(matches!(&e, LoadError::UnknownKey { key, .. } if key == "memroy"), "{e}");
        assert!(e.to_string().contains("listen, memory, count, fast, names, extra"), "{e}");
        std::fs::write(&p, "config = \"other.toml\"\n").unwrap();
        let e = Test::load_from(["testd", "--config", p.to_str().unwrap()], &env(&[])).unwrap_err();
        assert!(matches!(e, LoadError::UnknownKey { .. }), "a file cannot name another: {e}");
        std::fs::write(&p, "memory = \n").unwrap();
        let e = Test::load_from(["testd", "--config", p.to_str().unwrap()], &env(&[])).unwrap_err();
        assert!(matches!(e, LoadError::Syntax { .. }), "{e}");
        std::fs::write(&p, "listen = { a = 1 }\n").unwrap();
        let e = Test::load_from(["testd", "--config", p.to_str().unwrap()], &env(&[])).unwrap_err();
        assert!(matches!(e, LoadError::Value { .. }), "{e}");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
        let e = Test::load_from(["testd", "--config", "/nonexistent/rgpu.toml"], &env(&[])).unwrap_err();
        assert!(matches!(e, LoadError::Read { .. }), "{e}");
    }

    #[test]
    fn empty_environment_variables_are_unset() {
        let s = Test::load_from(["testd"], &env(&[("TESTD_LISTEN", "")])).unwrap().settings;
        assert_eq!(s.listen, "here");
    }

    #[test]
    fn help_shows_environment_variables_and_bool_syntax() {
        let help = Test::command().render_long_help().to_string();
        println!("{help}");
        assert!(help.contains("--listen <ADDR>") && help.contains("[env: TESTD_LISTEN]"), "{help}");
        assert!(help.contains("--fast[=<BOOL>]"), "{help}");
        assert!(help.contains("--config <FILE>") && help.contains("[env: TESTD_CONFIG]"), "{help}");
    }
}
