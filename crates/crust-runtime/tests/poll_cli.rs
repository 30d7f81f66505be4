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
    Command::new(bin)
        .args(args)
        .env_remove("RUST_LOG")
        .env("CRUST_RUNTIME_ROOT", roots.join("runtime"))
        .env("CRUST_RUNTIME_CRUST_ROOT", roots.join("crust"))
        .env("CRUST_RUNTIME_KATA_ROOT", roots.join("kata"))
        .output()
        .unwrap()
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
