//! Setting values from text: a flag's argument, an environment variable, or
//! a TOML value written the way the flag would be.

use std::path::PathBuf;
use std::str::FromStr;

/// A setting's type: how its value is read from text. A TOML value is
/// first turned into the text a flag would carry ([`toml_text`]), so the
/// three sources accept the same values.
pub trait FromText: Sized {
    fn from_text(s: &str) -> Result<Self, String>;
}

/// [`FromText`] through [`FromStr`], for setting types of other crates
/// (`parse = rgpu_config::via_from_str`).
pub fn via_from_str<T: FromStr>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.trim().parse().map_err(|e: T::Err| e.to_string())
}

macro_rules! from_str_types {
    ($($t:ty),*) => {$(
        impl FromText for $t {
            fn from_text(s: &str) -> Result<Self, String> {
                s.trim().parse().map_err(|e| format!("invalid value {s:?}: {e}"))
            }
        }
    )*};
}
from_str_types!(u8, u16, u32, u64, usize, i32, i64, f64);

impl FromText for String {
    fn from_text(s: &str) -> Result<Self, String> {
        Ok(s.to_string())
    }
}

impl FromText for PathBuf {
    fn from_text(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("empty path".into());
        }
        Ok(PathBuf::from(s))
    }
}

/// As clap's boolish values, so that `RGPU_X=1` and `x = true` both work.
impl FromText for bool {
    fn from_text(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "y" | "on" => Ok(true),
            "false" | "0" | "no" | "n" | "off" => Ok(false),
            _ => Err(format!("invalid value {s:?}: expected true or false")),
        }
    }
}

/// Comma-separated, as `--partitions a,b`; a TOML array is joined first.
impl FromText for Vec<String> {
    fn from_text(s: &str) -> Result<Self, String> {
        Ok(s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect())
    }
}

/// Settings that have no default: given means `Some`.
impl<T: FromText> FromText for Option<T> {
    fn from_text(s: &str) -> Result<Self, String> {
        T::from_text(s).map(Some)
    }
}

/// The text a flag would carry for a TOML value: strings as they are,
/// numbers and booleans as written (floats keep their point: `8.6`, `9.0`),
/// arrays of those joined with commas.
pub fn toml_text(v: &toml::Value) -> Result<String, String> {
    fn scalar(v: &toml::Value) -> Option<String> {
        match v {
            toml::Value::String(s) => Some(s.clone()),
            toml::Value::Integer(i) => Some(i.to_string()),
            toml::Value::Float(f) => Some(format!("{f:?}")),
            toml::Value::Boolean(b) => Some(b.to_string()),
            _ => None,
        }
    }
    match v {
        toml::Value::Array(items) => items
            .iter()
            .map(|i| scalar(i).ok_or_else(|| format!("array items must be strings or numbers, not {}", i.type_str())))
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.join(",")),
        other => scalar(other).ok_or_else(|| format!("expected a string, number or boolean, not a {}", other.type_str())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_values_read_as_flag_text() {
        let t: toml::Table = "a = 3\nb = 8.6\nc = 9.0\nd = true\ne = [\"x\", \"y\"]\nf = \"s\"\ng = { h = 1 }\n".parse().unwrap();
        assert_eq!(toml_text(&t["a"]).unwrap(), "3");
        assert_eq!(toml_text(&t["b"]).unwrap(), "8.6");
        assert_eq!(toml_text(&t["c"]).unwrap(), "9.0");
        assert_eq!(toml_text(&t["d"]).unwrap(), "true");
        assert_eq!(toml_text(&t["e"]).unwrap(), "x,y");
        assert_eq!(toml_text(&t["f"]).unwrap(), "s");
        assert!(toml_text(&t["g"]).is_err());
    }

    #[test]
    fn value_types() {
        assert_eq!(bool::from_text("YES"), Ok(true));
        assert_eq!(bool::from_text("off"), Ok(false));
        assert!(bool::from_text("maybe").is_err());
        assert_eq!(Vec::<String>::from_text(" a, b,,c "), Ok(vec!["a".into(), "b".into(), "c".into()]));
        assert_eq!(Option::<u16>::from_text("7"), Ok(Some(7)));
        assert!(u16::from_text("70000").is_err());
        assert!(PathBuf::from_text("").is_err());
        assert_eq!(via_from_str::<u8>(" 5 "), Ok(5));
    }
}
