//! The layers docs/architecture.md draws, as cargo sees them: the plugin
//! never links the VM stack, and the tools' parts never link the VMM.

use std::collections::BTreeSet;
use std::process::Command;

/// The workspace crates `package` links (normal dependencies, transitive).
fn links(package: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("crust-") || *n == "crustctl")
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_plugin_and_the_tools_parts_never_link_the_vm_stack() {
    let vm_stack = [
        "crust-vmm",
        "crust-sandbox",
        "crust-runtime",
        "crust-shim",
        "crust-podnet",
    ];
    for package in [
        "crust-csi",
        "crust-ops",
        "crust-bench",
        "crust-kubesim",
        "crust-report",
    ] {
        let linked = links(package);
        assert!(
            linked.contains(package),
            "cargo tree of {package}: {linked:?}"
        );
        let bad: Vec<&str> = vm_stack
            .iter()
            .copied()
            .filter(|c| linked.contains(*c))
            .collect();
        assert!(bad.is_empty(), "{package} links {bad:?}");
    }
    // The check sees a link where there is one.
    assert!(links("crust-shim").contains("crust-vmm"));
}

#[test]
fn each_door_stands_on_the_sandbox_and_not_on_the_other_door() {
    for (door, other) in [
        ("crust-shim", "crust-runtime"),
        ("crust-runtime", "crust-shim"),
    ] {
        let linked = links(door);
        assert!(linked.contains("crust-sandbox"), "{door}: {linked:?}");
        assert!(!linked.contains(other), "{door} links {other}");
    }
    let sandbox = links("crust-sandbox");
    for door in ["crust-shim", "crust-runtime"] {
        assert!(!sandbox.contains(door), "crust-sandbox links {door}");
    }
}
