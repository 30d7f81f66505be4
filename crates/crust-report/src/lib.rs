//! crust-report: how crust's tools print what they found, for people and
//! for programs.
//!
//! - [`Render`]: a result that prints as text or JSON ([`render`] in an
//!   [`OutputFormat`]); the CSI responses ([`csi`]), the kubelet simulator's step reports (crust-kubesim) and the
//!   benchmarks' reports (crust-bench) all implement it.
//! - [`table`]: left-aligned text columns.
//! - [`units`]: sizes and durations, parsed and shown.
//! - [`say`]: a progress line on stderr that survives a closed reader.

pub mod csi;
pub mod units;

/// A line on stderr that never panics: when whoever read our output is
/// gone (EPIPE), teardown must still run to its end.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// How a command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutputFormat {
    #[default]
    Text,
    Json,
}

/// Renders `v` in `format`; JSON is pretty-printed.
pub fn render<T: Render + ?Sized>(v: &T, format: OutputFormat) -> String {
    match format {
        OutputFormat::Json => {
            serde_json::to_string_pretty(&v.to_json()).expect("a Value always serializes")
        }
        OutputFormat::Text => v.to_text(),
    }
}

/// A response that can be printed for humans or as JSON.
pub trait Render {
    fn to_json(&self) -> serde_json::Value;
    /// Human-readable text; empty for responses that carry no data.
    fn to_text(&self) -> String;
}

/// Left-aligned columns separated by two spaces.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let pad = widths[i] - c.chars().count();
                s.push_str(c);
                s.push_str(&" ".repeat(pad + 2));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.to_vec());
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["xxxx".into(), "1".into()],
                vec!["y".into(), "2".into()],
            ],
        );
        assert_eq!(t, "A     LONGER\nxxxx  1\ny     2\n");
    }
}
