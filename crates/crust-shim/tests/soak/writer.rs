//! The checksummed writer that runs in every soak pod, and the checks of
//! what it left on a volume.
//!
//! Writer `W` appends records `"<n> <W> <c>\n"` to `/data/w-<W>.log`,
//! where `c` is the first 16 hex digits of sha256(`"<n> <W>\n"`), fsyncs
//! the file and `/data`, and only then prints `ack <n>` on stdout. The
//! acknowledgements reach the host through the pod's CRI log, so the
//! host's count can only trail what is durable, never lead it: every
//! acknowledged record must be on the volume, whatever happened after.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// The container command of writer `w` (busybox sh). A failed append or
/// fsync stops it with exit 3: a writer never acknowledges a write it
/// could not make durable.
pub fn script(w: &str) -> String {
    format!(
        "f=/data/w-{w}.log; n=0; while :; do n=$((n+1)); r=\"$n {w}\"; \
         c=$(echo \"$r\" | sha256sum | cut -c1-16); \
         echo \"$r $c\" >> \"$f\" && sync \"$f\" /data || {{ echo \"write-failed $n\"; exit 3; }}; \
         echo \"ack $n\"; sleep 0.3; done"
    )
}

/// The record line writer `w` writes as its `n`th.
pub fn record(w: &str, n: u64) -> String {
    let hash = Sha256::digest(format!("{n} {w}\n").as_bytes());
    let c: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{n} {w} {c}")
}

/// The highest `ack <n>` in a CRI log (`<time> stdout F ack <n>` lines).
pub fn acked(cri_log: &str) -> u64 {
    cri_log
        .lines()
        .filter_map(|l| l.split_once(" stdout F ack ").map(|(_, n)| n.trim()))
        .filter_map(|n| n.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// The shell command that dumps every writer's file for [`lost`].
pub const DUMP: &str =
    "for f in /data/w-*.log; do [ -e \"$f\" ] && echo \"== $f\" && cat \"$f\"; done; true";

/// Files of a [`DUMP`] output by writer name.
pub fn parse_dump(out: &str) -> BTreeMap<String, Vec<String>> {
    let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut cur: Option<String> = None;
    for l in out.lines() {
        if let Some(p) = l.strip_prefix("== /data/w-") {
            let w = p.trim_end_matches(".log").to_string();
            files.entry(w.clone()).or_default();
            cur = Some(w);
        } else if let Some(w) = &cur {
            files.entry(w.clone()).or_default().push(l.to_string());
        }
    }
    files
}

/// What is wrong with the acknowledged records `acked` (writer -> count)
/// given the volume's files: one line per writer whose records 1..=count
/// are not all there, in order and intact. Records past the count (written,
/// not yet acknowledged, maybe torn by a crash) are not checked.
pub fn lost(acked: &BTreeMap<String, u64>, files: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for (w, &count) in acked.iter().filter(|(_, c)| **c > 0) {
        let Some(lines) = files.get(w) else {
            out.push(format!(
                "writer {w}: {count} records acknowledged, its file is missing"
            ));
            continue;
        };
        if let Some(n) = (1..=count).find(|&n| lines.get(n as usize - 1) != Some(&record(w, n))) {
            out.push(format!(
                "writer {w}: {count} records acknowledged, record {n} is {:?} (expected {:?})",
                lines.get(n as usize - 1).map_or("absent", String::as_str),
                record(w, n)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_sees_a_lost_or_damaged_acknowledged_record() {
        let acked = BTreeMap::from([("p1".to_string(), 3)]);
        let good: Vec<String> = (1..=4).map(|n| record("p1", n)).collect();
        let mut files = BTreeMap::from([("p1".to_string(), good.clone())]);
        assert!(lost(&acked, &files).is_empty());
        // A torn record past the acknowledged ones is allowed.
        files.get_mut("p1").unwrap()[3] = "4 p1 0".into();
        assert!(lost(&acked, &files).is_empty());
        files.insert("p1".into(), good[..2].to_vec());
        assert_eq!(lost(&acked, &files).len(), 1, "record 3 lost");
        let mut bad = good.clone();
        bad[1] = record("p1", 2).replace(" p1 ", " p2 ");
        files.insert("p1".into(), bad);
        assert!(lost(&acked, &files)[0].contains("record 2"));
        assert_eq!(lost(&acked, &BTreeMap::new()).len(), 1, "file gone");
    }

    #[test]
    fn acks_and_dumps_parse() {
        let log = "2026-11-27T08:00:00Z stdout F ack 1\n\
                   2026-11-27T08:00:01Z stdout F ack 2\n\
                   2026-11-27T08:00:01Z stderr F noise\n";
        assert_eq!(acked(log), 2);
        let dump = format!(
            "== /data/w-p1.log\n{}\n== /data/w-p2.log\n",
            record("p1", 1)
        );
        let files = parse_dump(&dump);
        assert_eq!(files["p1"], [record("p1", 1)]);
        assert!(files["p2"].is_empty());
    }

    #[test]
    fn the_shell_computes_the_same_checksum() {
        let o = std::process::Command::new("sh")
            .arg("-c")
            .arg("r=\"7 p9\"; echo \"$r $(echo \"$r\" | sha256sum | cut -c1-16)\"")
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim_end(),
            record("p9", 7)
        );
    }
}
