//! Sizes and durations as people write and read them: `1Gi`, `512Mi`,
//! `10s`, `500ms` in; `1.0Gi`, `12.3ms` out. Parsers return plain `String`
//! errors so a command line (clap) shows them as usage errors.

use std::time::Duration;

/// Parses a byte size the way Kubernetes quantities are written:
/// `1048576`, `1Gi`, `512Mi`, `1G`, `1.5Gi`, `100k`. Binary suffixes
/// (`Ki Mi Gi Ti Pi Ei`) are powers of 1024, decimal ones (`k`/`K M G T P E`)
/// powers of 1000. A fractional result is rounded up to the next byte.
/// The result must fit CSI's int64.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let mult: u128 = match suffix {
        "" => 1,
        "k" | "K" => 1000,
        "M" => 1000u128.pow(2),
        "G" => 1000u128.pow(3),
        "T" => 1000u128.pow(4),
        "P" => 1000u128.pow(5),
        "E" => 1000u128.pow(6),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => {
            return Err(format!(
                "invalid size {s:?}: unknown suffix {suffix:?} (use e.g. 1Gi, 512Mi, 1G or bytes)"
            ));
        }
    };
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int_part.is_empty() && frac_part.is_empty()
        || frac_part.contains('.')
        || (num.contains('.') && frac_part.is_empty())
    {
        return Err(format!("invalid size {s:?}: expected a number"));
    }
    if int_part.len() + frac_part.len() > 30 {
        return Err(format!("invalid size {s:?}: too large"));
    }
    let digits: u128 = format!("{int_part}{frac_part}")
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected a number"))?;
    let scale = 10u128.pow(frac_part.len() as u32);
    let bytes = digits
        .checked_mul(mult)
        .ok_or_else(|| format!("invalid size {s:?}: too large"))?
        .div_ceil(scale);
    if bytes > i64::MAX as u128 {
        return Err(format!("invalid size {s:?}: larger than int64"));
    }
    Ok(bytes as u64)
}

/// Renders bytes with the largest binary unit that keeps the number >= 1,
/// e.g. `1.0Gi`, `512.0Mi`, `4096` stays `4.0Ki`.
pub fn human_size(bytes: i64) -> String {
    const UNITS: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if bytes.unsigned_abs() < 1024 {
        return format!("{bytes}B");
    }
    let mut v = bytes as f64;
    let mut unit = "";
    for u in UNITS {
        if v.abs() < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1}{unit}")
}

/// Parses `60s`, `500ms`, `2m`, `1h`, `1.5s`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 10s, 500ms, 2m"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "us" | "µs" => n / 1_000_000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => {
            return Err(format!(
                "invalid duration {s:?}: unknown unit {unit:?} (use ms, s, m, h)"
            ));
        }
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 366.0 * 86400.0 {
        return Err(format!("invalid duration {s:?}: must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Formats a latency compactly: `850µs`, `12.3ms`, `1.20s`.
pub fn human_duration(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0}µs")
    } else if us < 1e6 {
        format!("{:.1}ms", us / 1000.0)
    } else {
        format!("{:.2}s", us / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576").unwrap(), 1_048_576);
        assert_eq!(parse_size("1Gi").unwrap(), 1 << 30);
        assert_eq!(parse_size("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("100k").unwrap(), 100_000);
        assert_eq!(parse_size("100K").unwrap(), 100_000);
        assert_eq!(parse_size("4Ki").unwrap(), 4096);
        assert_eq!(parse_size("1.5Gi").unwrap(), 3 << 29);
        assert_eq!(parse_size("0.5Ki").unwrap(), 512);
        // rounds a fractional byte up
        assert_eq!(parse_size("0.0001Ki").unwrap(), 1);
        assert_eq!(parse_size("7Ei").unwrap(), 7 << 60);
        assert_eq!(parse_size("0").unwrap(), 0);
    }

    #[test]
    fn bad_sizes() {
        for bad in [
            "",
            "Gi",
            "1GB",
            "1g",
            "-1Gi",
            "1..5Gi",
            "1.Gi",
            "1 Gi",
            "8Ei",
            "abc",
            "1.2.3",
            "99999999999999999999999999999999999",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(parse_size("8Ei").unwrap_err().contains("int64"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("60").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        for bad in ["", "0s", "-1s", "s", "10x", "1e400"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn human() {
        assert_eq!(human_size(1 << 30), "1.0Gi");
        assert_eq!(human_size(512 << 20), "512.0Mi");
        assert_eq!(human_size(100), "100B");
        assert_eq!(human_duration(Duration::from_micros(850)), "850µs");
        assert_eq!(human_duration(Duration::from_micros(12_340)), "12.3ms");
        assert_eq!(human_duration(Duration::from_millis(1200)), "1.20s");
    }
}
