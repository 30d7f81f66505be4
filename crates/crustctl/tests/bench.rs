//! `crustctl bench` against a CSI server over a real unix socket: it
//! reports every scenario, honours capabilities, sends only standard calls,
//! and leaves nothing behind — after success, injected errors, or Ctrl-C.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use serde_json::Value;
use support::{Fake, NODE_ID, Options, TOPOLOGY_KEY};
use tonic::Code;

fn bench(fake: &Fake, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .arg("--endpoint")
        .arg(fake.endpoint())
        .arg("bench")
        .args(args)
        .output()
        .expect("run crustctl bench")
}

fn report(o: &Output) -> Value {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "bench failed ({:?}): {out}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

fn scenario<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["scenario"] == name)
        .unwrap_or_else(|| panic!("no scenario {name} in {r:#}"))
}

fn row<'a>(s: &'a Value, rpc: &str) -> Option<&'a Value> {
    s["rpcs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rpc"] == rpc)
}

fn count(s: &Value, rpc: &str) -> u64 {
    row(s, rpc).unwrap_or_else(|| panic!("no {rpc} row in {s:#}"))["count"]
        .as_u64()
        .unwrap()
}

fn assert_sane_latencies(r: &Value) {
    for s in r["scenarios"].as_array().unwrap() {
        for row in s["rpcs"].as_array().unwrap() {
            let (p50, p95, p99, max) = (
                row["p50_us"].as_u64().unwrap(),
                row["p95_us"].as_u64().unwrap(),
                row["p99_us"].as_u64().unwrap(),
                row["max_us"].as_u64().unwrap(),
            );
            assert!(p50 <= p95 && p95 <= p99 && p99 <= max, "{row}");
            if row["count"].as_u64().unwrap() > 0 {
                assert!(
                    max > 0 && row["ops_per_sec"].as_f64().unwrap() > 0.0,
                    "{row}"
                );
            }
        }
    }
}

/// Nothing under `dir` but what the test made itself.
fn assert_empty_dir(dir: &Path) {
    if dir.exists() {
        let left: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(
            left.is_empty(),
            "left behind in {}: {left:?}",
            dir.display()
        );
    }
}

#[test]
fn all_scenarios_report_and_clean_up() {
    let fake = Fake::start(Options::default());
    let work = tempfile::tempdir().unwrap();
    // roots that do not exist yet: bench makes them and removes them again
    let staging = work.path().join("plugins/globalmounts");
    let target = work.path().join("pods");
    let o = bench(
        &fake,
        &[
            "--ops",
            "12",
            "--concurrency",
            "3",
            "--stats-volumes",
            "3",
            "--size",
            "32Mi",
            "--fs-type",
            "ext4",
            "--param",
            "tier=fast",
            "--staging-dir",
            staging.to_str().unwrap(),
            "--target-dir",
            target.to_str().unwrap(),
            "-o",
            "json",
        ],
    );
    let r = report(&o);
    assert_eq!(r["driver"], support::DRIVER);
    let run_id = r["run_id"].as_str().unwrap().to_string();
    assert!(run_id.starts_with("crust-bench-"));
    assert_eq!(r["concurrency"], 3);
    assert_eq!(r["interrupted"], false);
    assert!(r["skipped"].as_array().unwrap().is_empty());

    let cd = scenario(&r, "create-delete");
    assert_eq!(
        (cd["ops"].as_u64(), cd["errors"].as_u64()),
        (Some(12), Some(0))
    );
    assert_eq!(count(cd, "CreateVolume"), 12);
    assert_eq!(count(cd, "DeleteVolume"), 12);
    assert_eq!(count(cd, "cycle"), 12);

    let sp = scenario(&r, "stage-publish-cycle");
    assert_eq!(
        (sp["ops"].as_u64(), sp["errors"].as_u64()),
        (Some(12), Some(0))
    );
    for rpc in [
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "cycle",
    ] {
        assert_eq!(count(sp, rpc), 12, "{rpc}");
    }
    let st = scenario(&r, "stats");
    assert_eq!(
        (st["ops"].as_u64(), st["errors"].as_u64()),
        (Some(12), Some(0))
    );
    assert_eq!(count(st, "NodeGetVolumeStats"), 12);
    assert_sane_latencies(&r);
    for s in r["scenarios"].as_array().unwrap() {
        for row in s["rpcs"].as_array().unwrap() {
            assert_eq!(row["errors"], 0, "{row}");
        }
    }
    assert!(r["cleanup"]["leftovers"].as_array().unwrap().is_empty());

    // The driver holds nothing; bench's directories are gone.
    assert_eq!(fake.held(), (0, 0, 0, 0));
    assert!(
        !staging.exists() && !target.exists(),
        "bench roots not removed"
    );
    assert!(
        !work.path().join("plugins").exists(),
        "parent made by bench not removed"
    );

    // Requests: unique names under the run id, the configured volume, the
    // node's topology, the volume context passed on, no KEP fields.
    let creates: Vec<csi::CreateVolumeRequest> = fake.requests("CreateVolume");
    assert_eq!(creates.len(), 12 + 3 + 3);
    let mut names: Vec<&str> = creates.iter().map(|c| c.name.as_str()).collect();
    assert!(names.iter().all(|n| n.starts_with(&run_id)));
    names.sort();
    names.dedup();
    assert_eq!(names.len(), creates.len(), "names not unique");
    for c in &creates {
        assert_eq!(c.capacity_range.unwrap().required_bytes, 32 << 20);
        assert_eq!(c.parameters["tier"], "fast");
        let Some(csi::volume_capability::AccessType::Mount(m)) =
            &c.volume_capabilities[0].access_type
        else {
            panic!("not a mount capability")
        };
        assert_eq!(m.fs_type, "ext4");
        let top = c.accessibility_requirements.as_ref().unwrap();
        assert_eq!(top.requisite[0].segments[TOPOLOGY_KEY], NODE_ID);
    }
    for s in fake.requests::<csi::NodeStageVolumeRequest>("NodeStageVolume") {
        assert!(s.volume_context.contains_key("fake.crust.io/name"));
        assert!(s.staging_target_path.starts_with(staging.to_str().unwrap()));
    }
    for p in fake.requests::<csi::NodePublishVolumeRequest>("NodePublishVolume") {
        assert!(!p.defer_fs_ops);
        assert!(p.target_path.starts_with(target.to_str().unwrap()));
        assert!(p.volume_context.contains_key("fake.crust.io/name"));
        let Some(csi::volume_capability::AccessType::Mount(m)) =
            p.volume_capability.unwrap().access_type
        else {
            panic!("not a mount capability")
        };
        assert!(m.volume_supplemental_group.is_empty());
    }
    assert!(
        fake.requests::<csi::NodeUnpublishVolumeRequest>("NodeUnpublishVolume")
            .iter()
            .all(|r| !r.defer_fs_ops)
    );
    // stats went round robin over all three published volumes
    let mut vols: Vec<String> = fake
        .requests::<csi::NodeGetVolumeStatsRequest>("NodeGetVolumeStats")
        .into_iter()
        .map(|r| r.volume_id)
        .collect();
    vols.sort();
    vols.dedup();
    assert_eq!(vols.len(), 3);
    assert_eq!(fake.count("ControllerPublishVolume"), 0);
}

#[test]
fn text_table_and_duration_mode() {
    let fake = Fake::start(Options::default());
    let o = bench(
        &fake,
        &[
            "--duration",
            "700ms",
            "--concurrency",
            "2",
            "--stats-volumes",
            "2",
            "--scenarios",
            "create-delete,stats",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with(&format!("driver {}", support::DRIVER)),
        "{text}"
    );
    assert!(lines[0].contains("0.7s per scenario"), "{text}");
    let header: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "SCENARIO", "RPC", "COUNT", "ERRORS", "OPS/S", "P50", "P95", "P99", "MAX"
        ]
    );
    let stats_row: Vec<&str> = lines
        .iter()
        .find(|l| l.starts_with("stats"))
        .expect("stats row")
        .split_whitespace()
        .collect();
    assert_eq!(stats_row[1], "NodeGetVolumeStats");
    assert!(stats_row[2].parse::<u64>().unwrap() > 0);
    assert_eq!(stats_row[3], "0");
    assert!(text.contains("0 left over"), "{text}");
    assert!(!text.contains("stage-publish-cycle"));
    assert_eq!(fake.held(), (0, 0, 0, 0));
}

#[test]
fn skips_stage_when_not_advertised() {
    let fake = Fake::start(Options {
        stage_unstage: false,
        ..Options::default()
    });
    let r = report(&bench(
        &fake,
        &[
            "--ops",
            "6",
            "--concurrency",
            "2",
            "--scenarios",
            "stage-publish-cycle,stats",
            "--stats-volumes",
            "2",
            "-o",
            "json",
        ],
    ));
    let notes = r["notes"].to_string();
    assert!(notes.contains("STAGE_UNSTAGE_VOLUME"), "{notes}");
    let sp = scenario(&r, "stage-publish-cycle");
    assert_eq!(
        (sp["ops"].as_u64(), sp["errors"].as_u64()),
        (Some(6), Some(0))
    );
    assert!(row(sp, "NodeStageVolume").is_none() && row(sp, "NodeUnstageVolume").is_none());
    assert_eq!(count(sp, "NodePublishVolume"), 6);
    assert_eq!(count(scenario(&r, "stats"), "NodeGetVolumeStats"), 6);
    assert_eq!(fake.count("NodeStageVolume"), 0);
    assert_eq!(fake.count("NodeUnstageVolume"), 0);
    assert!(
        fake.requests::<csi::NodePublishVolumeRequest>("NodePublishVolume")
            .iter()
            .all(|p| p.staging_target_path.is_empty())
    );
    assert_eq!(fake.held(), (0, 0, 0, 0));
}

#[test]
fn skips_scenarios_whose_rpcs_are_missing() {
    let fake = Fake::start(Options {
        stats: false,
        ..Options::default()
    });
    let r = report(&bench(
        &fake,
        &[
            "--ops",
            "3",
            "--scenarios",
            "create-delete,stats",
            "-o",
            "json",
        ],
    ));
    let skipped = r["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0]["scenario"], "stats");
    assert!(
        skipped[0]["reason"]
            .as_str()
            .unwrap()
            .contains("GET_VOLUME_STATS")
    );
    assert_eq!(scenario(&r, "create-delete")["ops"], 3);
    assert_eq!(fake.count("NodeGetVolumeStats"), 0);
    assert_eq!(fake.count("NodePublishVolume"), 0);
    let text =
        String::from_utf8_lossy(&bench(&fake, &["--ops", "1", "--scenarios", "stats"]).stdout)
            .to_string();
    assert!(
        text.contains("skipped stats: node does not advertise GET_VOLUME_STATS"),
        "{text}"
    );
}

#[test]
fn errors_are_counted_and_cleaned_up() {
    let mut fail = std::collections::HashMap::new();
    fail.insert("NodePublishVolume", (3, Code::Unavailable));
    fail.insert("DeleteVolume", (4, Code::Unavailable));
    fail.insert("NodeUnstageVolume", (5, Code::Internal));
    let fake = Fake::start(Options {
        fail_every: fail,
        ..Options::default()
    });
    let work = tempfile::tempdir().unwrap();
    let o = bench(
        &fake,
        &[
            "--ops",
            "15",
            "--concurrency",
            "3",
            "--stats-volumes",
            "2",
            "--staging-dir",
            work.path().to_str().unwrap(),
            "--target-dir",
            work.path().to_str().unwrap(),
            "-o",
            "json",
        ],
    );
    let r = report(&o);
    let cd = scenario(&r, "create-delete");
    assert!(
        row(cd, "DeleteVolume").unwrap()["errors"].as_u64().unwrap() > 0,
        "{cd:#}"
    );
    let sp = scenario(&r, "stage-publish-cycle");
    assert!(sp["errors"].as_u64().unwrap() > 0);
    // failed cycles show in the cycle row too
    assert_eq!(row(sp, "cycle").unwrap()["errors"], sp["errors"]);
    assert_eq!(row(sp, "cycle").unwrap()["count"], sp["ops"]);
    assert!(
        row(sp, "NodePublishVolume").unwrap()["errors"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(
        sp["error_samples"].to_string().contains("injected failure"),
        "{sp:#}"
    );
    assert_eq!(
        sp["ops"].as_u64().unwrap() + sp["errors"].as_u64().unwrap(),
        15,
        "{sp:#}"
    );
    assert!(
        r["cleanup"]["leftovers"].as_array().unwrap().is_empty(),
        "{:#}",
        r["cleanup"]
    );
    // everything undone on the driver and on disk (the given roots stay)
    assert_eq!(fake.held(), (0, 0, 0, 0));
    assert!(work.path().exists());
    assert_empty_dir(work.path());
}

#[test]
fn defer_fs_ops_only_when_asked_and_advertised() {
    let fake = Fake::start(Options::default());
    report(&bench(
        &fake,
        &[
            "--ops",
            "4",
            "--concurrency",
            "2",
            "--stats-volumes",
            "1",
            "--defer-fs-ops",
            "--supplemental-group",
            "100",
            "--supplemental-group-change-policy",
            "OnRootMismatch",
            "--scenarios",
            "stage-publish-cycle,stats",
            "-o",
            "json",
        ],
    ));
    let pubs: Vec<csi::NodePublishVolumeRequest> = fake.requests("NodePublishVolume");
    assert!(!pubs.is_empty() && pubs.iter().all(|p| p.defer_fs_ops));
    for p in &pubs {
        let Some(csi::volume_capability::AccessType::Mount(m)) =
            p.volume_capability.clone().unwrap().access_type
        else {
            panic!("not a mount capability")
        };
        assert_eq!(m.volume_supplemental_group, "100");
        assert_eq!(m.volume_supplemental_group_change_policy, "OnRootMismatch");
    }
    assert!(
        fake.requests::<csi::NodeUnpublishVolumeRequest>("NodeUnpublishVolume")
            .iter()
            .all(|p| p.defer_fs_ops)
    );
    assert!(
        fake.requests::<csi::NodeGetVolumeStatsRequest>("NodeGetVolumeStats")
            .iter()
            .all(|p| p.defer_fs_ops)
    );
    assert_eq!(fake.held(), (0, 0, 0, 0));

    let stock = Fake::start(Options {
        defer: false,
        ..Options::default()
    });
    let o = bench(
        &stock,
        &[
            "--ops",
            "1",
            "--defer-fs-ops",
            "--scenarios",
            "stage-publish-cycle",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("DEFER_FS_OPS"), "{err}");
    // KEP fields without a deferral run are a usage error
    let o = bench(&stock, &["--ops", "1", "--supplemental-group", "100"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("need --defer-fs-ops"));
    assert_eq!(stock.count("CreateVolume"), 0, "nothing may be created");
}

#[test]
fn attaches_when_the_controller_publishes() {
    let fake = Fake::start(Options {
        controller_publish: true,
        ..Options::default()
    });
    let r = report(&bench(
        &fake,
        &[
            "--ops",
            "4",
            "--concurrency",
            "2",
            "--stats-volumes",
            "2",
            "--block",
            "--scenarios",
            "stage-publish-cycle,stats",
            "-o",
            "json",
        ],
    ));
    assert!(r["notes"].to_string().contains("PUBLISH_UNPUBLISH_VOLUME"));
    assert_eq!(scenario(&r, "stage-publish-cycle")["ops"], 4);
    assert_eq!(fake.count("ControllerPublishVolume"), 2 + 2);
    assert_eq!(fake.count("ControllerUnpublishVolume"), 2 + 2);
    for s in fake.requests::<csi::NodeStageVolumeRequest>("NodeStageVolume") {
        assert_eq!(
            s.publish_context["devicePath"],
            format!("/dev/fake/{}", s.volume_id)
        );
        assert!(matches!(
            s.volume_capability.unwrap().access_type,
            Some(csi::volume_capability::AccessType::Block(_))
        ));
    }
    assert_eq!(fake.held(), (0, 0, 0, 0));
}

#[test]
fn interrupt_stops_and_cleans_up() {
    let fake = Fake::start(Options::default());
    let work = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .arg("--endpoint")
        .arg(fake.endpoint())
        .args([
            "bench",
            "--duration",
            "60s",
            "--concurrency",
            "2",
            "--stats-volumes",
            "2",
        ])
        .args(["--scenarios", "stage-publish-cycle,stats", "-o", "json"])
        .arg("--staging-dir")
        .arg(work.path())
        .arg("--target-dir")
        .arg(work.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard_pid = child.id();
    let child = crust_testkit::ChildGuard::new(child);
    // wait until the run is under way
    let t0 = Instant::now();
    while fake.count("NodeUnpublishVolume") < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "bench did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Command::new("kill")
        .args(["-INT", &guard_pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t1 = Instant::now();
    let out = child.into_inner().wait_with_output().unwrap();
    assert!(
        t1.elapsed() < Duration::from_secs(20),
        "cleanup took too long"
    );
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("interrupted"));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["interrupted"], true);
    // the second scenario never started
    assert!(r["scenarios"].as_array().unwrap().len() <= 1);
    assert_eq!(fake.held(), (0, 0, 0, 0));
    assert_empty_dir(work.path());
}

/// `--stats-volumes 1,3` runs the stats scenario once per value, with
/// that many published volumes each time, and prints cost against N;
/// `--idle-loops 3` holds three foreign loop devices for the whole run
/// (seen attached while the plugin serves the calls) and releases them.
#[test]
fn stats_sweep_and_idle_loops() {
    crust_testkit::require_root();
    let fake = Fake::start(Options::default());
    let loops_now = || {
        crust_blockdev::list_loops()
            .unwrap()
            .into_iter()
            .filter(|l| {
                l.backing_file
                    .to_string_lossy()
                    .starts_with("/var/tmp/crust-bench-idle-loops.")
            })
            .count()
    };
    let before = loops_now();
    let child = Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .arg("--endpoint")
        .arg(fake.endpoint())
        .args([
            "bench",
            "--scenarios",
            "stats",
            "--duration",
            "1s",
            "--stats-volumes",
            "1,3",
            "--idle-loops",
            "3",
            "-o",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // While the first run measures: the idle devices are attached.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = 0;
    while Instant::now() < deadline && seen < before + 3 {
        seen = loops_now();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(seen, before + 3, "three idle loop devices held");
    let o = child.wait_with_output().unwrap();
    let r = report(&o);
    let runs = r["sweep"].as_array().expect("a sweep");
    let ns: Vec<u64> = runs
        .iter()
        .map(|x| x["stats_volumes"].as_u64().unwrap())
        .collect();
    assert_eq!(ns, [1, 3]);
    for x in runs {
        let s = scenario(&x["report"], "stats");
        assert!(count(s, "NodeGetVolumeStats") > 0, "{x:#}");
        assert!(
            x["report"]["notes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n.as_str().unwrap().starts_with("3 idle loop devices")),
            "{x:#}"
        );
    }
    assert_eq!(loops_now(), before, "idle loop devices released");
    assert_eq!(fake.held(), (0, 0, 0, 0));

    // Text: one table per N, then the cost against N.
    let o = bench(
        &fake,
        &[
            "--scenarios",
            "stats",
            "--ops",
            "20",
            "--stats-volumes",
            "1,2",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{text}");
    assert!(text.contains("== 1 published volumes =="), "{text}");
    assert!(text.contains("== 2 published volumes =="), "{text}");
    let cost = text
        .split("== stats cost against published volumes ==")
        .nth(1)
        .expect("cost table");
    let rows: Vec<Vec<&str>> = cost
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| !r.is_empty())
        .collect();
    assert_eq!(rows.len(), 2, "{cost}");
    assert_eq!((rows[0][0], rows[1][0]), ("1", "2"), "{cost}");
    assert_eq!(rows[0][5], "1.00x", "{cost}");
}
