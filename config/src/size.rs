//! Byte counts as people write them: `4096`, `512MiB`, `1.5GiB`, `1_000MB`.

/// Parses a byte count: a number with an optional unit. `KiB`/`MiB`/`GiB`/
/// `TiB`/`PiB` (and `K`/`M`/`G`/`T`/`P`) are powers of 1024, `KB`/`MB`/`GB`/
/// `TB`/`PB` powers of 1000, `B` or nothing is bytes; units ignore case and
/// may follow a space. `_` may group digits. A decimal (`1.5GiB`) is
/// rounded down to whole bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '_' && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || format!("invalid size {s:?}: expected e.g. 4096, 512MiB, 1.5GiB or 16GiB");
    let num = num.replace('_', "");
    let (int, frac) = num.split_once('.').unwrap_or((&num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(bad());
    }
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        u => {
            return Err(format!(
                "invalid size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB or PB)"
            ))
        }
    };
    let too_large = || format!("size {s:?} is too large");
    // Integer arithmetic, so that `1.5GiB` is exactly 3 << 29 and large
    // integers keep every digit (a float would not).
    let int: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| too_large())? };
    // Digits past 18 change the result by less than a byte in a PiB.
    let frac = &frac[..frac.len().min(18)];
    let frac_bytes = if frac.is_empty() {
        0
    } else {
        let digits: u128 = frac.parse().map_err(|_| bad())?;
        digits * mult / 10u128.pow(frac.len() as u32)
    };
    let total = int.checked_mul(mult).and_then(|v| v.checked_add(frac_bytes)).ok_or_else(too_large)?;
    u64::try_from(total).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn plain_numbers_and_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("20GiB"), Ok(20 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("3K"), Ok(3 << 10));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_size("1pib"), Ok(1 << 50));
        assert_eq!(parse_size("100b"), Ok(100));
    }

    #[test]
    fn decimal_units() {
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("2kb"), Ok(2_000));
        assert_eq!(parse_size("1PB"), Ok(1_000_000_000_000_000));
    }

    #[test]
    fn decimals_are_exact_and_round_down() {
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5MiB"), Ok(512 << 10));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("2.KiB"), Ok(2048));
        assert_eq!(parse_size("0.1KiB"), Ok(102));
        assert_eq!(parse_size("1.9"), Ok(1));
        assert_eq!(parse_size("1.000000000000000000001GiB"), Ok(1 << 30));
    }

    #[test]
    fn separators_and_spaces() {
        assert_eq!(parse_size("1_000_000"), Ok(1_000_000));
        assert_eq!(parse_size("1_024MiB"), Ok(1 << 30));
        assert_eq!(parse_size("  16 GiB "), Ok(16 << 30));
        assert_eq!(parse_size("1.2_5KB"), Ok(1_250));
    }

    #[test]
    fn limits() {
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert!(parse_size("18446744073709551616").is_err());
        assert_eq!(parse_size("16383.999PiB").map(|v| v > 0), Ok(true));
        assert!(parse_size("16384PiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert!(parse_size("999999999999999999999999999999999999999999GiB").is_err());
    }

    #[test]
    fn rejects() {
        for bad in ["", " ", "GiB", ".", "_", "x", "12XB", "1.2.3GiB", "-1", "-1GiB", "1e9", "1 2GiB", "0x10"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
        let e = parse_size("12XB").unwrap_err();
        assert!(e.contains("unknown unit") && e.contains("12XB"), "{e}");
    }
}
