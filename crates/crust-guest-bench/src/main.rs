//! `crust-guest-bench MODE ARGS...`: one JSON object on stdout, or an
//! error on stderr and exit status 1.
//!
//!   meta DIR FILES SIZE      create+write+fsync+stat FILES files, unlink them
//!   tree DIR ENTRIES         build a tree of ENTRIES entries
//!   walk DIR                 readdir + lstat every entry below DIR
//!   features DIR             native-feature probes + statfs in DIR (fresh)
//!   statfs PATH              statvfs figures of PATH

use std::path::Path;

use crust_guest_bench::{features, meta};

fn num(s: Option<&String>, what: &str) -> Result<usize, String> {
    s.ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|e| format!("{what}: {e}"))
}

fn run(args: &[String]) -> Result<serde_json::Value, String> {
    let mode = args.first().map(String::as_str).unwrap_or("");
    let path = args.get(1).map(Path::new);
    let need = || path.ok_or_else(|| format!("{mode}: missing path"));
    match mode {
        "meta" => meta::create_fsync_stat_unlink(
            need()?,
            num(args.get(2), "file count")?,
            num(args.get(3), "file size")?,
        ),
        "tree" => meta::make_tree(need()?, num(args.get(2), "entry count")?),
        "walk" => meta::walk(need()?),
        "features" => {
            let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
            features::run_all(need()?, &exe)
        }
        "statfs" => features::statfs(need()?),
        "probe-lock" => {
            let p = args
                .get(2)
                .map(Path::new)
                .ok_or("probe-lock: missing path")?;
            features::probe_lock(args[1].as_str(), p)
        }
        "probe-open" => std::process::exit(features::probe_open(need()?)),
        _ => Err(format!(
            "usage: crust-guest-bench meta DIR FILES SIZE | tree DIR ENTRIES | walk DIR | features DIR | statfs PATH (got {mode:?})"
        )),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("crust-guest-bench: {e}");
            std::process::exit(1);
        }
    }
}
