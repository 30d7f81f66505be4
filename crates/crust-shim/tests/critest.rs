//! Issue 43, must-show 1: the Kubernetes CRI validation suite (critest,
//! kubernetes-sigs/cri-tools) against one containerd with the runc handler
//! and with crust's, same selection and seed, images imported offline.
//! The test fails on any case that passes under runc and not under crust
//! unless [`DIFFERENCES`] lists it, with its reason, and the README's
//! critest table names it too; it prints both handlers' counts.
//!
//! Selection: [`SKIP`] says what is left out and why. Budget: runc
//! ~3 min, crust (one TCG guest per pod, one pod at a time) ~10 min. `CRUST_CRITEST_FOCUS=REGEX`
//! narrows both runs to matching cases.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Left out, as one ginkgo skip expression: the image groups (containerd
/// 1.6's PullImage contacts the registry), NRI (no NRI socket), image
/// volumes (not in containerd 1.6), the benchmarks, and the cases that
/// need the suite's real e2e images (nginx's master process, procps'
/// pgrep, ipcs, nonewprivs, httpd's access log), which fail under runc
/// here too and only cost their timeouts.
const SKIP: &str = concat!(
    r"\[k8s\.io\] (Image Manager|Image Identifier|Image Consistency|Image Volume|NRI)",
    r"|\[Benchmark\]",
    r"|should support (HostPID|ContainerPID|HostIpc is false)$",
    r"|NoNewPrivs|execSync with timeout|multiple containers in a pod should support container log",
);

/// Cases that pass under runc and not under crust, by design, each with
/// why; the README's critest section lists them.
const DIFFERENCES: &[(&str, &str)] = &[
    (
        "should support HostPID",
        "hostPID: a VM cannot share the host's PID namespace; refused naming \
         the setting (CRUST_SHIM_HOST_NAMESPACES=pid runs it in the guest's)",
    ),
    (
        "should support HostIpc is true",
        "hostIPC: refused like hostPID (CRUST_SHIM_HOST_NAMESPACES=ipc)",
    ),
    (
        "should support HostNetwork is true",
        "hostNetwork: refused by default; CRUST_SHIM_HOST_NETWORK=user gives \
         a user-mode network, never the host's interfaces",
    ),
    (
        "portforward in host network",
        "hostNetwork: refused by default (above)",
    ),
    (
        "mount with 'rshared' should support propagation from host to container and vice versa",
        "Bidirectional propagation: mounts made in the guest cannot reach the host; \
         refused naming the mount",
    ),
    (
        "should support non-recursive readonly mounts",
        "passes in the container; the suite's cleanup then fails: while the pod runs, \
         crust's share holds the host path's mounts in the host's mount namespace, so \
         unlinking the tmpfs mount point there gives EBUSY (runc's copies are in the \
         container's namespace)",
    ),
];

/// critest: `CRUST_CRITEST`, else `../shared/tools/critest` beside the
/// checkout.
fn critest_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CRUST_CRITEST") {
        return Some(PathBuf::from(p));
    }
    let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tools/critest");
    beside.is_file().then_some(beside)
}

/// One case's outcome: `passed`, `failed`, `skipped`...
type Outcomes = BTreeMap<String, String>;

/// Runs the selection against `handler` and reads ginkgo's JSON report.
fn run(critest: &Path, env: &common::Env, handler: &str, dir: &Path) -> Outcomes {
    let report = dir.join(format!("report-{handler}.json"));
    let images = dir.join("images.yaml");
    std::fs::write(
        &images,
        format!(
            "defaultTestContainerImage: {}\nwebServerTestImage: {}\n",
            crust_testkit::BUSYBOX_IMAGE,
            crust_testkit::WEBSERVER_IMAGE
        ),
    )
    .unwrap();
    let endpoint = env.ctrd.endpoint();
    let mut cmd = Command::new(critest);
    // A narrower run while working on one group.
    if let Ok(focus) = std::env::var("CRUST_CRITEST_FOCUS") {
        cmd.args(["--ginkgo.focus", &focus]);
    }
    // The suite's host paths (os.MkdirTemp) go below `dir`: what a failed
    // case leaves there goes with it.
    let out = cmd
        .current_dir(dir)
        .env("TMPDIR", dir)
        .args([
            "--runtime-endpoint",
            &endpoint,
            "--image-endpoint",
            &endpoint,
            "--runtime-handler",
            handler,
            "--test-images-file",
            images.to_str().unwrap(),
            "--ginkgo.seed",
            "43",
            "--ginkgo.no-color",
            "--ginkgo.timeout",
            "40m",
            "--ginkgo.skip",
            SKIP,
            "--ginkgo.json-report",
            report.to_str().unwrap(),
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run critest");
    let log = String::from_utf8_lossy(&out.stdout);
    std::fs::write(dir.join(format!("critest-{handler}.log")), log.as_bytes()).unwrap();
    let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        panic!(
            "critest wrote no report ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            &log[log.len().saturating_sub(4000)..]
        )
    });
    outcomes(&text)
}

/// Each `It` of the report by its full name.
fn outcomes(report: &str) -> Outcomes {
    let v: serde_json::Value = serde_json::from_str(report).expect("ginkgo JSON report");
    let mut out = Outcomes::new();
    for suite in v.as_array().into_iter().flatten() {
        for s in suite["SpecReports"].as_array().into_iter().flatten() {
            if s["LeafNodeType"] != "It" {
                continue;
            }
            let mut name: Vec<&str> = s["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str())
                .collect();
            name.push(s["LeafNodeText"].as_str().unwrap_or("?"));
            out.insert(
                name.join(" "),
                s["State"].as_str().unwrap_or("?").to_string(),
            );
        }
    }
    out
}

/// Mounts a failed case of the suite left below its temp dir (a refused
/// container skips the case's own cleanup): released on drop.
struct UnmountBelow(PathBuf);

impl Drop for UnmountBelow {
    fn drop(&mut self) {
        crust_testkit::unmount_below(&self.0);
    }
}

fn counts(o: &Outcomes) -> (usize, usize, usize) {
    let n = |st: &str| o.values().filter(|s| s.as_str() == st).count();
    (
        n("passed"),
        o.len() - n("passed") - n("skipped"),
        n("skipped"),
    )
}

#[test]
fn critest_passes_under_crust_what_it_passes_under_runc() {
    let Some(critest) = critest_binary() else {
        crust_testkit::missing_tool(
            "critest not found: set CRUST_CRITEST or lay ../shared/tools/critest beside the \
             checkout (its README says how to build it)",
        );
        return;
    };
    // The node's defaults: hostNetwork refused.
    // CNI as a cluster has it: a bridge with host ports (portmap).
    let (env, _bridge, _ipam) = common::bridge_env(
        "crct",
        94,
        vec![serde_json::json!({"type": "portmap", "capabilities": {"portMappings": true}})],
        vec![("CRUST_SHIM_HOST_NETWORK".into(), "refuse".into())],
    );
    let web = crust_testkit::test_images_dir().join("webserver.tar");
    env.ctrd
        .import_images(crust_testkit::CRI_NAMESPACE, &[web.as_path()]);
    // The suite's own web-server names, for the groups that hard-code them.
    for alias in [
        "registry.k8s.io/e2e-test-images/nginx:1.14-2",
        "registry.k8s.io/e2e-test-images/httpd:2.4.39-4",
    ] {
        env.ctrd.ctr_in(
            crust_testkit::CRI_NAMESPACE,
            &[
                "images",
                "tag",
                "--force",
                crust_testkit::WEBSERVER_IMAGE,
                alias,
            ],
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let _mounts = UnmountBelow(dir.path().to_path_buf());
    let t0 = std::time::Instant::now();
    let runc = run(&critest, &env, "runc", dir.path());
    let runc_time = t0.elapsed();
    let crust = run(&critest, &env, crust_testkit::CRUST_HANDLER, dir.path());
    let crust_time = t0.elapsed() - runc_time;
    let (rp, rf, rs) = counts(&runc);
    let (cp, cf, cs) = counts(&crust);
    eprintln!(
        "critest: runc {rp} passed, {rf} failed, {rs} skipped ({runc_time:.0?}); \
         crust {cp} passed, {cf} failed, {cs} skipped ({crust_time:.0?})"
    );
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let mut unexplained = Vec::new();
    for (case, state) in &runc {
        let theirs = crust.get(case).map(String::as_str).unwrap_or("missing");
        if state != "passed" || theirs == "passed" {
            continue;
        }
        eprintln!("runc passed, crust {theirs}: {case}");
        match DIFFERENCES.iter().find(|(c, _)| case.contains(c)) {
            Some((c, _)) if readme.contains(c) => {}
            Some((c, _)) => {
                unexplained.push(format!("{case} (listed here, not in the README: {c})"))
            }
            None => unexplained.push(case.clone()),
        }
    }
    for (case, state) in &crust {
        if state == "passed" && runc.get(case).is_some_and(|s| s != "passed") {
            eprintln!("crust passed, runc {}: {case}", runc[case]);
        }
    }
    assert!(
        unexplained.is_empty(),
        "cases passing under runc but not crust:\n{}\n(logs in {})",
        unexplained.join("\n"),
        dir.keep().display()
    );
}
