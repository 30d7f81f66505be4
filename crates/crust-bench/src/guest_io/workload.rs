//! The workloads of `bench --guest-io`: fio jobs (Debian's fio in the
//! bench guest image) and the metadata modes of `crust-guest-bench`, the
//! command lines that run them in the guest and the parsing of what they
//! print.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

/// The guest helper of the bench image.
pub const HELPER: &str = "crust-guest-bench";

/// What a workload does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// 4 KiB random writes, fsync after each.
    RandWriteFsync,
    /// 4 KiB random reads, cold caches.
    RandRead,
    /// 1 MiB sequential writes of a whole file, fsync at the end (inside
    /// fio's measured time).
    SeqWrite,
    /// 1 MiB sequential reads of a whole file, cold caches.
    SeqRead,
    /// create + write + fsync + stat of small files, then unlink.
    Meta,
    /// readdir + lstat of every entry of a tree, cold caches.
    Walk,
    /// The same walk with the guest's caches warm (one unmeasured walk
    /// first): what a second `find`, a build's stat storm or `git status`
    /// over a working tree sees. virtio-fs still asks the host to
    /// revalidate; the block volume's guest answers from its own caches.
    WalkWarm,
}

/// How a workload's result is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    Iops,
    BytesPerSec,
    FilesPerSec,
    EntriesPerSec,
}

impl Unit {
    pub fn format(self, v: f64) -> String {
        match self {
            Unit::Iops => format!("{v:.0} IOPS"),
            Unit::BytesPerSec => format!("{:.1} MiB/s", v / (1 << 20) as f64),
            Unit::FilesPerSec => format!("{v:.0} files/s"),
            Unit::EntriesPerSec => format!("{v:.0} entries/s"),
        }
    }
}

/// One workload at one queue depth (1 for the metadata ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Workload {
    pub kind: Kind,
    pub queue_depth: u32,
}

/// Sizes and durations (long form defaults: [`Sizes::long`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sizes {
    /// File of the random workloads.
    pub rand_file: u64,
    /// File of the sequential workloads (written and read whole).
    pub seq_file: u64,
    /// Length of each time-based (random) fio run.
    #[serde(with = "secs")]
    pub runtime: Duration,
    pub meta_files: u32,
    pub meta_file_size: u32,
    pub walk_entries: u32,
}

mod secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

impl Sizes {
    /// The documented long form: 256 MiB random file, 512 MiB sequential
    /// file, 15 s per random run, 10,000 files, a 50,000-entry tree.
    pub fn long() -> Sizes {
        Sizes {
            rand_file: 256 << 20,
            seq_file: 512 << 20,
            runtime: Duration::from_secs(15),
            meta_files: 10_000,
            meta_file_size: 4096,
            walk_entries: 50_000,
        }
    }

    /// The CI form: small files, 1 s runs, 200 files, 2,000 entries.
    pub fn short() -> Sizes {
        Sizes {
            rand_file: 16 << 20,
            seq_file: 32 << 20,
            runtime: Duration::from_secs(1),
            meta_files: 200,
            meta_file_size: 4096,
            walk_entries: 2_000,
        }
    }

    /// Bytes the workloads occupy on one volume at most.
    pub fn footprint(&self) -> u64 {
        self.rand_file
            + self.seq_file
            + self.meta_files as u64 * (self.meta_file_size as u64).max(4096)
            + self.walk_entries as u64 * 4096
    }
}

impl Workload {
    /// Every workload: the four fio ones at each queue depth, then the
    /// metadata ones.
    pub fn all(queue_depths: &[u32]) -> Vec<Workload> {
        let mut v = Vec::new();
        for kind in [
            Kind::RandWriteFsync,
            Kind::RandRead,
            Kind::SeqWrite,
            Kind::SeqRead,
        ] {
            for &queue_depth in queue_depths {
                v.push(Workload { kind, queue_depth });
            }
        }
        v.push(Workload {
            kind: Kind::Meta,
            queue_depth: 1,
        });
        for kind in [Kind::Walk, Kind::WalkWarm] {
            v.push(Workload {
                kind,
                queue_depth: 1,
            });
        }
        v
    }

    pub fn is_fio(&self) -> bool {
        !matches!(self.kind, Kind::Meta | Kind::Walk | Kind::WalkWarm)
    }

    /// Read workloads start from cold caches (guest and host dropped).
    pub fn cold(&self) -> bool {
        matches!(self.kind, Kind::RandRead | Kind::SeqRead | Kind::Walk)
    }

    pub fn unit(&self) -> Unit {
        match self.kind {
            Kind::RandWriteFsync | Kind::RandRead => Unit::Iops,
            Kind::SeqWrite | Kind::SeqRead => Unit::BytesPerSec,
            Kind::Meta => Unit::FilesPerSec,
            Kind::Walk | Kind::WalkWarm => Unit::EntriesPerSec,
        }
    }

    /// Short name, e.g. `randwrite-fsync-4k-qd16`.
    pub fn name(&self) -> String {
        match self.kind {
            Kind::RandWriteFsync => format!("randwrite-fsync-4k-qd{}", self.queue_depth),
            Kind::RandRead => format!("randread-4k-qd{}", self.queue_depth),
            Kind::SeqWrite => format!("seqwrite-1m-qd{}", self.queue_depth),
            Kind::SeqRead => format!("seqread-1m-qd{}", self.queue_depth),
            Kind::Meta => "meta-create-fsync-stat-unlink".into(),
            Kind::Walk => "walk-tree".into(),
            Kind::WalkWarm => "walk-tree-warm".into(),
        }
    }

    /// What the latency columns measure.
    pub fn latency_of(&self) -> &'static str {
        match self.kind {
            Kind::RandWriteFsync => "fsync",
            Kind::RandRead | Kind::SeqRead => "read completion",
            Kind::SeqWrite => "write completion",
            Kind::Meta => "create+write+fsync+stat of one file",
            Kind::Walk | Kind::WalkWarm => "-",
        }
    }

    /// The guest command line, working in `dir` (the bench directory of
    /// one mount).
    pub fn command(&self, dir: &str, s: &Sizes) -> Vec<String> {
        match self.kind {
            Kind::Meta => vec![
                HELPER.into(),
                "meta".into(),
                format!("{dir}/meta"),
                s.meta_files.to_string(),
                s.meta_file_size.to_string(),
            ],
            Kind::Walk | Kind::WalkWarm => {
                vec![HELPER.into(), "walk".into(), format!("{dir}/tree")]
            }
            Kind::RandWriteFsync | Kind::RandRead => self.fio_job(&format!("{dir}/rand.dat"), s),
            Kind::SeqWrite | Kind::SeqRead => self.fio_job(&format!("{dir}/seq.dat"), s),
        }
    }

    /// What runs unmeasured (its time and host CPU not counted) just
    /// before [`Workload::command`]: the warm walk's first walk.
    pub fn warm_up(&self, dir: &str, s: &Sizes) -> Option<Vec<String>> {
        (self.kind == Kind::WalkWarm).then(|| self.command(dir, s))
    }

    /// The fio job of a fio workload on `filename`: a file, or a block
    /// device of which it uses the first `size` bytes (the random file's
    /// or the sequential file's). Empty for the metadata workloads.
    pub fn fio_job(&self, filename: &str, s: &Sizes) -> Vec<String> {
        let (size, rw, bs) = match self.kind {
            Kind::RandWriteFsync => (s.rand_file, "randwrite", "4k"),
            Kind::RandRead => (s.rand_file, "randread", "4k"),
            Kind::SeqWrite => (s.seq_file, "write", "1m"),
            Kind::SeqRead => (s.seq_file, "read", "1m"),
            Kind::Meta | Kind::Walk | Kind::WalkWarm => return Vec::new(),
        };
        let mut a: Vec<String> = [
            "fio",
            "--name=crust",
            "--output-format=json",
            "--ioengine=io_uring",
            "--percentile_list=50:99",
            "--randrepeat=0",
            "--invalidate=1",
        ]
        .map(String::from)
        .to_vec();
        a.push(format!("--filename={filename}"));
        a.push(format!("--size={size}"));
        a.push(format!("--rw={rw}"));
        a.push(format!("--bs={bs}"));
        a.push(format!("--iodepth={}", self.queue_depth));
        let runtime = format!("--runtime={}ms", s.runtime.as_millis().max(1));
        match self.kind {
            Kind::RandWriteFsync => {
                a.extend([
                    "--time_based".into(),
                    runtime,
                    "--norandommap".into(),
                    "--fsync=1".into(),
                ]);
            }
            // Each block at most once (fio's random map, no time-based
            // wrap-around): every read misses the dropped caches.
            Kind::RandRead => a.push(runtime),
            Kind::SeqWrite => a.push("--end_fsync=1".into()),
            _ => {}
        }
        a
    }
}

/// fio commands laying out the files of the fio workloads (not timed).
pub fn layout_commands(dir: &str, s: &Sizes) -> Vec<Vec<String>> {
    [("rand.dat", s.rand_file), ("seq.dat", s.seq_file)]
        .iter()
        .map(|(f, size)| {
            vec![
                "fio".into(),
                "--name=layout".into(),
                "--output-format=json".into(),
                "--create_only=1".into(),
                "--rw=write".into(),
                "--bs=1m".into(),
                format!("--filename={dir}/{f}"),
                format!("--size={size}"),
            ]
        })
        .collect()
}

/// One run's figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Measured {
    /// In the workload's [`Unit`].
    pub value: f64,
    /// Bytes read + written by the workload.
    pub bytes: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    /// The tool's own measured time.
    pub seconds: f64,
    /// A walk's reads from the block device under its tree; absent where
    /// the filesystem has no device of its own (virtio-fs, btrfs, overlay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_reads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_read_bytes: Option<u64>,
}

impl Measured {
    /// Figures without device counts.
    pub fn new(
        value: f64,
        bytes: u64,
        p50_us: Option<f64>,
        p99_us: Option<f64>,
        seconds: f64,
    ) -> Measured {
        Measured {
            value,
            bytes,
            p50_us,
            p99_us,
            seconds,
            device_reads: None,
            device_read_bytes: None,
        }
    }
}

fn f(v: &Value, path: &[&str]) -> Option<f64> {
    let mut cur = v;
    for p in path {
        cur = cur.get(*p)?;
    }
    cur.as_f64()
}

/// Parses what the workload's command printed.
pub fn parse(w: &Workload, stdout: &str) -> Result<Measured, String> {
    // fio may print notes before its JSON.
    let start = stdout.find('{').ok_or("no JSON in the output")?;
    let v: Value = serde_json::from_str(&stdout[start..]).map_err(|e| format!("bad JSON: {e}"))?;
    let num =
        |path: &[&str]| f(&v, path).ok_or_else(|| format!("no {} in the output", path.join(".")));
    match w.kind {
        Kind::Meta => Ok(Measured::new(
            num(&["files_per_s"])?,
            (num(&["files"])? * num(&["file_size"])?) as u64,
            Some(num(&["create_fsync_stat", "p50_us"])?),
            Some(num(&["create_fsync_stat", "p99_us"])?),
            num(&["seconds"])?,
        )),
        Kind::Walk | Kind::WalkWarm => Ok(Measured {
            device_reads: v.get("device_reads").and_then(Value::as_u64),
            device_read_bytes: v.get("device_read_bytes").and_then(Value::as_u64),
            ..Measured::new(num(&["entries_per_s"])?, 0, None, None, num(&["seconds"])?)
        }),
        _ => {
            let job = v
                .get("jobs")
                .and_then(|j| j.get(0))
                .ok_or("fio printed no job")?;
            if let Some(e) = job.get("error").and_then(Value::as_i64)
                && e != 0
            {
                return Err(format!("fio job error {e}"));
            }
            let dir = if matches!(w.kind, Kind::RandRead | Kind::SeqRead) {
                "read"
            } else {
                "write"
            };
            let g = |path: &[&str]| {
                f(job, path).ok_or_else(|| format!("no jobs[0].{} in fio's output", path.join(".")))
            };
            let bytes = g(&[dir, "io_bytes"])? as u64;
            if bytes == 0 {
                return Err(format!("fio moved no bytes ({dir})"));
            }
            let runtime_ms = g(&[dir, "runtime"])?;
            let value = match w.unit() {
                Unit::Iops => g(&[dir, "iops"])?,
                _ => g(&[dir, "bw_bytes"])?,
            };
            let lat = if w.kind == Kind::RandWriteFsync {
                ["sync", "lat_ns"]
            } else {
                [dir, "clat_ns"]
            };
            let pct = |p: &str| {
                job.get(lat[0])
                    .and_then(|d| d.get(lat[1]))
                    .and_then(|l| l.get("percentile"))
                    .and_then(|m| m.get(p))
                    .and_then(Value::as_f64)
                    .map(|ns| ns / 1000.0)
            };
            Ok(Measured::new(
                value,
                bytes,
                pct("50.000000"),
                pct("99.000000"),
                runtime_ms / 1000.0,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workload_once_per_depth() {
        let all = Workload::all(&[1, 16]);
        assert_eq!(all.len(), 11);
        let names: Vec<String> = all.iter().map(Workload::name).collect();
        assert!(names.contains(&"randwrite-fsync-4k-qd16".to_string()));
        assert!(names.contains(&"seqread-1m-qd1".to_string()));
        assert_eq!(all.iter().filter(|w| w.cold()).count(), 5);
        // The warm walk: caches kept, one walk to fill them, the second measured.
        let warm = all.last().unwrap();
        assert_eq!(
            (warm.kind, warm.cold(), warm.is_fio()),
            (Kind::WalkWarm, false, false)
        );
        let walk = ["crust-guest-bench", "walk", "/data/b/tree"];
        assert_eq!(warm.command("/data/b", &Sizes::short()), walk);
        assert_eq!(warm.warm_up("/data/b", &Sizes::short()).unwrap(), walk);
        assert!(
            all[..10]
                .iter()
                .all(|w| w.warm_up("/d", &Sizes::short()).is_none())
        );
    }

    #[test]
    fn fio_command_lines() {
        let s = Sizes::short();
        let w = Workload {
            kind: Kind::RandWriteFsync,
            queue_depth: 16,
        };
        let c = w.command("/data/crust-bench", &s);
        for want in [
            "--filename=/data/crust-bench/rand.dat",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--fsync=1",
            "--time_based",
            "--runtime=1000ms",
            "--size=16777216",
        ] {
            assert!(c.contains(&want.to_string()), "{want} not in {c:?}");
        }
        let c = Workload {
            kind: Kind::RandRead,
            queue_depth: 1,
        }
        .command("/d", &s);
        assert!(
            !c.contains(&"--time_based".to_string()) && !c.contains(&"--norandommap".to_string())
        );
        assert!(c.contains(&"--runtime=1000ms".to_string()));
        let c = Workload {
            kind: Kind::SeqWrite,
            queue_depth: 1,
        }
        .command("/d", &s);
        assert!(
            c.contains(&"--end_fsync=1".to_string()) && !c.contains(&"--time_based".to_string())
        );
        let c = Workload {
            kind: Kind::Meta,
            queue_depth: 1,
        }
        .command("/d", &s);
        assert_eq!(c, ["crust-guest-bench", "meta", "/d/meta", "200", "4096"]);
    }

    /// Shapes taken from fio 3.33's JSON output.
    #[test]
    fn parses_fio_and_helper_output() {
        let fio = r#"note: both iodepth >= 1 and synchronous I/O engine are selected
{"fio version":"fio-3.33","jobs":[{"jobname":"crust","error":0,
 "write":{"io_bytes":9637888,"bw_bytes":3198000,"iops":780.69,"runtime":3013,
   "clat_ns":{"percentile":{"50.000000":4079616,"99.000000":21889024}}},
 "read":{"io_bytes":0,"bw_bytes":0,"iops":0.0,"runtime":0},
 "sync":{"total_ios":2361,"lat_ns":{"percentile":{"50.000000":12648448,"99.000000":43778048}}}}]}"#;
        let w = Workload {
            kind: Kind::RandWriteFsync,
            queue_depth: 1,
        };
        let m = parse(&w, fio).unwrap();
        assert_eq!(m.value, 780.69);
        assert_eq!(m.bytes, 9637888);
        assert_eq!(m.p50_us, Some(12648.448));
        assert_eq!(m.p99_us, Some(43778.048));
        assert_eq!(m.seconds, 3.013);
        // The same output read as a read workload moved nothing: an error.
        let r = Workload {
            kind: Kind::RandRead,
            queue_depth: 1,
        };
        assert!(parse(&r, fio).unwrap_err().contains("no bytes"));
        let sw = Workload {
            kind: Kind::SeqWrite,
            queue_depth: 1,
        };
        let m = parse(&sw, fio).unwrap();
        assert_eq!((m.value, m.p99_us), (3198000.0, Some(21889.024)));
        assert!(
            parse(&w, r#"{"jobs":[{"error":5}]}"#)
                .unwrap_err()
                .contains("error 5")
        );
        assert!(parse(&w, "fio: no such file").is_err());

        let meta = r#"{"create_fsync_stat":{"p50_us":912.9,"p99_us":5436.0},"file_size":4096,"files":200,"files_per_s":501.2,"seconds":0.39}"#;
        let m = parse(
            &Workload {
                kind: Kind::Meta,
                queue_depth: 1,
            },
            meta,
        )
        .unwrap();
        assert_eq!((m.value, m.bytes, m.p99_us), (501.2, 819200, Some(5436.0)));
        let walk = r#"{"entries":2000,"entries_per_s":27390.5,"seconds":0.073}"#;
        let m = parse(
            &Workload {
                kind: Kind::Walk,
                queue_depth: 1,
            },
            walk,
        )
        .unwrap();
        assert_eq!((m.value, m.p50_us, m.bytes), (27390.5, None, 0));
        // No device under the tree: unknown, not zero.
        assert_eq!((m.device_reads, m.device_read_bytes), (None, None));
        let walk = r#"{"entries":2000,"entries_per_s":9000.0,"seconds":0.2,"device_reads":41,"device_read_bytes":1048576}"#;
        let m = parse(
            &Workload {
                kind: Kind::WalkWarm,
                queue_depth: 1,
            },
            walk,
        )
        .unwrap();
        assert_eq!(
            (m.value, m.device_reads, m.device_read_bytes),
            (9000.0, Some(41), Some(1 << 20))
        );
    }
}
