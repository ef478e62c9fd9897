//! Link bandwidths as people write them: `10Gb/s` (bits), `1.25GB/s`
//! (bytes), `400Mbps`. Kept in bytes per second.

use crate::size::parse_size;

/// Parses a bandwidth into bytes per second: a number, then a unit ending in
/// `/s` or `ps`. A lowercase `b` (or `bit`) counts bits, an uppercase `B`
/// bytes: `10Gb/s` is 1.25 GB/s. Prefixes as [`parse_size`]'s: `k`/`M`/`G`/
/// `T` powers of 1000, `Ki`/`Mi`/`Gi`/`Ti` powers of 1024 (prefix case does
/// not matter). A number alone is bytes per second. Bits are rounded down
/// to whole bytes.
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let bad = || format!("invalid bandwidth {s:?}: expected e.g. 10Gb/s, 400Mb/s or 1.25GB/s (b: bits, B: bytes)");
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '_' && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if unit.is_empty() {
        return parse_size(num).map_err(|_| bad());
    }
    let per = unit.strip_suffix("/s").or_else(|| unit.strip_suffix("ps")).ok_or_else(bad)?;
    let (prefix, bits) = if let Some(p) = per.strip_suffix("bit") {
        (p, true)
    } else if let Some(p) = per.strip_suffix('b') {
        (p, true)
    } else if let Some(p) = per.strip_suffix('B') {
        (p, false)
    } else {
        return Err(bad());
    };
    if prefix.chars().any(|c| !c.is_ascii_alphabetic()) {
        return Err(bad());
    }
    let n = parse_size(&format!("{num}{prefix}B")).map_err(|e| {
        if e.contains("too large") {
            format!("bandwidth {s:?} is too large")
        } else {
            bad()
        }
    })?;
    Ok(if bits { n / 8 } else { n })
}

/// Bytes per second as bits, the way links are sold: `10Gb/s`, `400Mb/s`.
pub fn format_bandwidth(bytes_per_s: u64) -> String {
    let bits = bytes_per_s as f64 * 8.0;
    let (v, u) = if bits >= 1e12 {
        (bits / 1e12, "Tb/s")
    } else if bits >= 1e9 {
        (bits / 1e9, "Gb/s")
    } else if bits >= 1e6 {
        (bits / 1e6, "Mb/s")
    } else if bits >= 1e3 {
        (bits / 1e3, "kb/s")
    } else {
        (bits, "b/s")
    };
    let v = format!("{v:.1}");
    format!("{}{u}", v.strip_suffix(".0").unwrap_or(&v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_and_bytes() {
        assert_eq!(parse_bandwidth("10Gb/s"), Ok(1_250_000_000));
        assert_eq!(parse_bandwidth("10 Gb/s"), Ok(1_250_000_000));
        assert_eq!(parse_bandwidth("100Mb/s"), Ok(12_500_000));
        assert_eq!(parse_bandwidth("400Mbps"), Ok(50_000_000));
        assert_eq!(parse_bandwidth("1Gbit/s"), Ok(125_000_000));
        assert_eq!(parse_bandwidth("2GB/s"), Ok(2_000_000_000));
        assert_eq!(parse_bandwidth("1.25GB/s"), Ok(1_250_000_000));
        assert_eq!(parse_bandwidth("1GiB/s"), Ok(1 << 30));
        assert_eq!(parse_bandwidth("1gb/s"), Ok(125_000_000), "the prefix's case does not matter, b's does");
        assert_eq!(parse_bandwidth("1.5Gb/s"), Ok(187_500_000));
        assert_eq!(parse_bandwidth("5000"), Ok(5000));
        assert_eq!(parse_bandwidth("9b/s"), Ok(1), "rounded down to whole bytes");
    }

    #[test]
    fn what_is_refused() {
        for bad in ["", "Gb/s", "10Gb", "10G/s", "10 fast/s", "10Xb/s", "1.2.3Gb/s", "-1Gb/s", "10G-b/s"] {
            assert!(parse_bandwidth(bad).is_err(), "{bad:?}");
        }
        assert!(parse_bandwidth("99999999999PB/s").unwrap_err().contains("too large"));
    }

    #[test]
    fn shown_in_bits() {
        assert_eq!(format_bandwidth(1_250_000_000), "10Gb/s");
        assert_eq!(format_bandwidth(12_500_000), "100Mb/s");
        assert_eq!(format_bandwidth(1_000_000_000), "8Gb/s");
        assert_eq!(format_bandwidth(3_125_000_000_000 / 2), "12.5Tb/s");
        assert_eq!(format_bandwidth(0), "0b/s");
        for n in [1_250_000_000u64, 50_000_000, 125_000] {
            assert_eq!(parse_bandwidth(&format_bandwidth(n)), Ok(n));
        }
    }
}
