//! `crust-runtime-poll`, the runtime CLI sandboxes record for crust_ops:
//! it answers kubelet's stats polls itself and hands every other command
//! line to `crust-runtime` next to it, which then answers exactly as when
//! run directly (output and exit status). No guest needed (< 1 s); the
//! stats it answers from a guest are checked in `guest_volumes`.

use std::path::Path;
use std::process::{Command, Output};

const FULL: &str = env!("CARGO_BIN_EXE_crust-runtime");
const POLL: &str = env!("CARGO_BIN_EXE_crust-runtime-poll");

fn run(bin: &Path, args: &[&str], roots: &Path) -> Output {
    let mut tries = 0;
    loop {
        match Command::new(bin)
            .args(args)
            .env_remove("RUST_LOG")
            .env("CRUST_RUNTIME_ROOT", roots.join("runtime"))
            .env("CRUST_RUNTIME_CRUST_ROOT", roots.join("crust"))
            .env("CRUST_RUNTIME_KATA_ROOT", roots.join("kata"))
            .output()
        {
            // A binary just copied by one test is briefly "busy" while a
            // parallel test's fork still holds the copy's write descriptor.
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r.unwrap(),
        }
    }
}

#[test]
fn other_verbs_are_handed_to_the_full_runtime_and_answer_alike() {
    let d = tempfile::tempdir().unwrap();
    for args in [
        &["crust", "capabilities"][..],
        &["--version"],
        &["crust", "no-such-verb", "/x"],
        &["crust", "stats", "/not/a/published/volume"],
        &["direct-volume", "stats", "--volume-path", "/not/a/volume"],
        &["state", "no-such-sandbox"],
    ] {
        let full = run(Path::new(FULL), args, d.path());
        let poll = run(Path::new(POLL), args, d.path());
        assert_eq!(
            (poll.status.code(), &poll.stdout, &poll.stderr),
            (full.status.code(), &full.stdout, &full.stderr),
            "{args:?}: {poll:?} vs {full:?}"
        );
    }
    // The unsupported-verb answer crust_ops tells from a failure.
    let out = run(Path::new(POLL), &["crust", "no-such-verb", "/x"], d.path());
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn without_the_full_runtime_next_to_it_other_verbs_fail_clearly() {
    let d = tempfile::tempdir().unwrap();
    let alone = d.path().join("crust-runtime-poll");
    std::fs::copy(POLL, &alone).unwrap();
    let out = run(&alone, &["crust", "capabilities"], d.path());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "cannot run {}",
            d.path().join("crust-runtime").display()
        )),
        "{err}"
    );
}

/// `crust freeze TARGET MS` (what crust_ops runs) refuses a time limit
/// outside 1..=600000 ms before it looks for the sandbox or its guest:
/// the message names the limit, not the missing volume, and both
/// binaries answer it alike.
#[test]
fn freeze_beyond_the_limit_is_refused_before_any_guest() {
    let d = tempfile::tempdir().unwrap();
    let limit = crust_agent_proto::MAX_FROZEN_MS;
    for ms in [0, limit + 1, u64::MAX] {
        let ms = ms.to_string();
        for bin in [FULL, POLL] {
            let out = run(
                Path::new(bin),
                &["crust", "freeze", "/not/a/published/volume", &ms],
                d.path(),
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{bin} {ms}: {err}");
            assert!(
                err.contains(&format!("between 1 and {limit}, not {ms}")),
                "{bin} {ms}: {err}"
            );
        }
    }
    // In range it gets as far as the record (none here).
    let out = run(
        Path::new(FULL),
        &["crust", "freeze", "/not/a/published/volume", "1000"],
        d.path(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1) && !err.contains("between 1"),
        "{err}"
    );
}
