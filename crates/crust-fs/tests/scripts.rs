//! The hand-kept tool lists of the image and dependency scripts name every
//! tool and package the [`FsSpec`]s name: a filesystem added here, or a
//! tool removed from a script, fails this test instead of failing at run
//! time in an image without the tool.
//!
//! * `scripts/install-deps.sh` (the build and test machine): every
//!   filesystem's package in `pkgs=(…)`, and every host and guest tool in
//!   the `--if-missing` check.
//! * `scripts/build-images.sh` (the CSI plugin's image): every host tool in
//!   the loop that copies the plugin's tools.
//! * `guest/build-image.sh` (the guest image): every guest tool found with
//!   `X=$(tool <tool> <package>)` and copied with
//!   `add_prog "$X" /usr/sbin/<tool>` (where the agent runs it), and every
//!   filesystem's kernel module in `FS_MODULES`.

use std::collections::BTreeSet;
use std::path::Path;

use crust_fs::{FsSpec, FsType};

fn script(rel: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn specs() -> impl Iterator<Item = &'static FsSpec> {
    FsType::ALL.into_iter().map(FsType::spec)
}

/// The words of the shell `for t in WORDS; do` that starts at `from` (line
/// continuations joined).
fn for_loop_words(text: &str, from: usize) -> BTreeSet<String> {
    let rest = &text[from..];
    let start = rest.find("for t in ").expect("a `for t in` loop") + "for t in ".len();
    let end = start + rest[start..].find("; do").expect("`; do`");
    rest[start..end]
        .replace("\\\n", " ")
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// The words of the bash array `name=( … )`, comments dropped.
fn array_words(text: &str, name: &str) -> BTreeSet<String> {
    let open = format!("{name}=(");
    let start = text.find(&open).unwrap_or_else(|| panic!("no {open}")) + open.len();
    let end = start + text[start..].find("\n)").expect("closing )");
    text[start..end]
        .lines()
        .flat_map(|l| l.split('#').next().unwrap_or("").split_whitespace())
        .map(String::from)
        .collect()
}

fn missing<'a>(
    want: impl IntoIterator<Item = &'a str>,
    have: &BTreeSet<String>,
) -> BTreeSet<&'a str> {
    want.into_iter().filter(|t| !have.contains(*t)).collect()
}

#[test]
fn install_deps_installs_and_checks_every_tool() {
    let text = script("scripts/install-deps.sh");
    let pkgs = array_words(&text, "pkgs");
    let lost = missing(specs().map(|s| s.package), &pkgs);
    assert!(lost.is_empty(), "install-deps.sh pkgs lacks {lost:?}");

    let check = text
        .find("--if-missing\" ]")
        .expect("the --if-missing branch");
    let tools = for_loop_words(&text, check);
    let lost = missing(
        specs().flat_map(|s| s.host_tools().into_iter().chain(s.guest_tools())),
        &tools,
    );
    assert!(
        lost.is_empty(),
        "install-deps.sh --if-missing does not check {lost:?}"
    );
}

#[test]
fn csi_image_has_every_host_tool() {
    let text = script("scripts/build-images.sh");
    let copy = text
        .find("copy_elf_rootfs \"$(find_tool \"$t\")\" \"$csi\"")
        .expect("the loop copying the CSI plugin's tools");
    let loop_start = text[..copy].rfind("for t in ").expect("its `for t in`");
    let tools = for_loop_words(&text, loop_start);
    let lost = missing(specs().flat_map(FsSpec::host_tools), &tools);
    assert!(
        lost.is_empty(),
        "build-images.sh does not copy {lost:?} into the CSI image"
    );
}

#[test]
fn guest_image_has_every_guest_tool_and_module() {
    let text = script("guest/build-image.sh");
    for spec in specs() {
        for tool in spec.guest_tools() {
            let found = text
                .lines()
                .find_map(|l| {
                    let (var, call) = l.split_once("=$(tool ")?;
                    let mut w = call.trim_end_matches(')').split_whitespace();
                    (w.next() == Some(tool)).then(|| (var.trim(), w.next().map(String::from)))
                })
                .unwrap_or_else(|| panic!("build-image.sh lacks `X=$(tool {tool} …)`"));
            let (var, package) = found;
            assert_eq!(
                package.as_deref(),
                Some(spec.package),
                "build-image.sh: {tool}'s package"
            );
            let copy = format!("add_prog \"${var}\" /usr/sbin/{tool}\n");
            assert!(text.contains(&copy), "build-image.sh lacks {copy:?}");
        }
    }
    let modules = text
        .lines()
        .find_map(|l| l.strip_prefix("FS_MODULES=\""))
        .and_then(|l| l.strip_suffix('"'))
        .expect("FS_MODULES=\"…\"");
    let modules: BTreeSet<String> = modules.split_whitespace().map(String::from).collect();
    let lost = missing(specs().map(|s| s.name), &modules);
    assert!(lost.is_empty(), "build-image.sh FS_MODULES lacks {lost:?}");
}
