//! The floor holds: unsafe code is in crust-sys alone. The compiler
//! enforces it for every target it builds (the workspace's
//! `unsafe_code = "forbid"`); this test keeps every crate under that lint
//! and catches unsafe code in targets or `cfg`s a build here never
//! compiles (another architecture, another libc).

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn crates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    v.sort();
    v
}

/// The value of `key` in `[section]` of a TOML file (plain `key = value`
/// lines only: enough for the manifests of this workspace).
fn toml_value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == format!("[{section}]");
            continue;
        }
        if inside
            && let Some((k, v)) = line.split_once('=')
            && k.trim() == key
        {
            return Some(v.trim().to_string());
        }
    }
    None
}

#[test]
fn the_workspace_forbids_unsafe_code_and_every_crate_but_the_floor_takes_its_lints() {
    let root = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    assert_eq!(
        toml_value(&root, "workspace.lints.rust", "unsafe_code").as_deref(),
        Some("\"forbid\"")
    );
    let mut outside = Vec::new();
    for dir in crates() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let takes = toml_value(&manifest, "lints", "workspace").as_deref() == Some("true");
        if name == "crust-sys" {
            assert!(!takes, "crust-sys keeps its own lint table");
        } else if !takes {
            outside.push(name);
        }
    }
    assert!(
        outside.is_empty(),
        "crates without `[lints] workspace = true`: {outside:?}"
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Whether a line of code (comments dropped) opens unsafe code: a block,
/// function, impl, trait or extern block.
fn opens_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '{'))
        .filter(|w| !w.is_empty())
        .collect();
    words
        .windows(2)
        .any(|w| w[0] == "unsafe" && matches!(w[1], "{" | "fn" | "impl" | "trait" | "extern"))
        || words.iter().any(|w| w.starts_with("unsafe{"))
        || code.contains("unsafe {")
}

#[test]
fn no_source_outside_the_floor_opens_unsafe_code() {
    let mut found = Vec::new();
    for dir in crates() {
        if dir.ends_with("crust-sys") {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for (n, line) in text.lines().enumerate() {
                if opens_unsafe(line) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "unsafe code outside crust-sys:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_what_it_looks_for() {
    assert!(opens_unsafe("    let x = unsafe { f() };"));
    assert!(opens_unsafe("pub unsafe fn g() {}"));
    assert!(opens_unsafe("unsafe impl Send for T {}"));
    assert!(opens_unsafe("unsafe extern \"C\" {"));
    assert!(!opens_unsafe("    // SAFETY: unsafe { in a comment }"));
    assert!(!opens_unsafe("let unsafe_root = 1;"));
    assert!(!opens_unsafe(
        "#[error(\"hand-off root {path} is unsafe: {reason}\")]"
    ));
}
