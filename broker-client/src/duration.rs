//! Durations as operators and users write them for the broker's API: a
//! lease's `--ttl 10m`, `--wait 30s`, a drain's `--deadline 2h`. (Sizes,
//! `--memory 20GiB`, are `rgpu_config::parse_size`, the daemons' parser.)

/// A duration in milliseconds: `30s`, `5m`, `2h`, `1d`, `500ms`, or plain
/// seconds; a decimal (`1.5h`) is rounded down to whole milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 5m or 2h"))?;
    let mult = match unit.trim() {
        "ms" => 1.0,
        "" | "s" => 1e3,
        "m" | "min" => 60e3,
        "h" => 3600e3,
        "d" => 86400e3,
        u => return Err(format!("invalid duration {s:?}: unknown unit {u:?} (ms, s, m, h, d)")),
    };
    Ok((n * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("90"), Ok(90_000));
        assert_eq!(parse_duration_ms(" 2m "), Ok(120_000));
        assert_eq!(parse_duration_ms("2min"), Ok(120_000));
        assert_eq!(parse_duration_ms("1.5h"), Ok(5_400_000));
        assert_eq!(parse_duration_ms("1d"), Ok(86_400_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert!(parse_duration_ms("5 fortnights").is_err());
        assert!(parse_duration_ms("soon").is_err());
        assert!(parse_duration_ms("").is_err());
    }
}
