//! The guest's `/sbin/modprobe`: the agent binary run under that name,
//! which is how the kernel asks for a module it lacks (`modprobe -q --
//! rtnl-link-bridge` when a container with NET_ADMIN makes a bridge).
//!
//! The image keeps modules flat in `/lib/modules/<name>.ko` (decompressed)
//! with two indexes the image build writes: [`DEPS`], one line per module
//! with everything it needs in load order (itself last), and [`ALIASES`],
//! the kernel's own `alias <pattern> <module>` lines for those modules.
//! Modules not in the image's root are in the network payload, unpacked on
//! first need.

use std::path::Path;

/// `<module> <dep>... <module>`: the load order of each module.
pub const DEPS: &str = "/etc/modules.order";
/// `alias <pattern> <module>` (depmod's modules.alias, the image's part).
pub const ALIASES: &str = "/etc/modules.alias";
/// The optional payload holding the modules not in the image's root.
pub const PAYLOAD: &str = "network";

/// Entry point when run as `modprobe`; returns the exit code.
pub fn main(args: &[String]) -> i32 {
    let names: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if args.iter().any(|a| a == "-r" || a == "--remove") {
        eprintln!("modprobe: removing modules is not supported in a crust guest");
        return 1;
    }
    let quiet = args.iter().any(|a| a == "-q" || a == "--quiet");
    let mut code = 0;
    for name in names {
        if let Err(e) = load(name) {
            if !quiet {
                eprintln!("modprobe: {e}");
            }
            code = 1;
        }
    }
    code
}

/// Loads `name` (a module name or an alias the kernel asks for) and what
/// it needs.
pub fn load(name: &str) -> Result<(), String> {
    let module = normalize(name);
    if Path::new("/sys/module").join(&module).exists() {
        return Ok(());
    }
    let deps = std::fs::read_to_string(DEPS).unwrap_or_default();
    let module = if order_of(&deps, &module).is_some() {
        module
    } else {
        let aliases = std::fs::read_to_string(ALIASES).unwrap_or_default();
        resolve_alias(&aliases, name).ok_or_else(|| format!("{name}: no such module"))?
    };
    let order = order_of(&deps, &module).ok_or_else(|| format!("{module}: no such module"))?;
    for m in &order {
        if Path::new("/sys/module").join(m).join("initstate").exists() {
            continue;
        }
        let ko = Path::new("/lib/modules").join(format!("{m}.ko"));
        if !ko.exists() {
            crate::sys::unpack_payload(PAYLOAD)?;
        }
        let f = std::fs::File::open(&ko).map_err(|e| format!("opening {}: {e}", ko.display()))?;
        match rustix::system::finit_module(&f, c"", 0) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("loading {m} (for {name}): {e}")),
        }
    }
    Ok(())
}

/// Module names compare with `-` and `_` alike, as the kernel's do.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The load order [`DEPS`] gives `module`.
fn order_of(deps: &str, module: &str) -> Option<Vec<String>> {
    deps.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next()? == module).then(|| w.map(String::from).collect())
    })
}

/// The module of the first alias whose pattern matches `name`.
fn resolve_alias(aliases: &str, name: &str) -> Option<String> {
    aliases.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next()? == "alias").then_some(())?;
        let (pattern, module) = (w.next()?, w.next()?);
        (glob(pattern.as_bytes(), name.as_bytes())
            || glob(pattern.as_bytes(), normalize(name).as_bytes()))
        .then(|| normalize(module))
    })
}

/// fnmatch's `*`, `?` and `[...]` (what modules.alias patterns use).
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && glob(rest, &s[1..]),
        Some((b'[', rest)) => {
            let Some(end) = rest.iter().position(|&c| c == b']') else {
                return s.first() == Some(&b'[') && glob(rest, &s[1..]);
            };
            let (class, after) = (&rest[..end], &rest[end + 1..]);
            let Some(&c) = s.first() else { return false };
            let hit = class
                .windows(3)
                .any(|w| w[1] == b'-' && w[0] <= c && c <= w[2])
                || class.contains(&c);
            hit && glob(after, &s[1..])
        }
        Some((&c, rest)) => s.first() == Some(&c) && glob(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_fnmatch_does() {
        assert!(glob(b"rtnl-link-bridge", b"rtnl-link-bridge"));
        assert!(!glob(b"rtnl-link-bridge", b"rtnl-link-bridg"));
        assert!(glob(b"pci:v00001AF4d*sv*", b"pci:v00001AF4d00001000sv0000"));
        assert!(glob(b"net-pf-1[06]", b"net-pf-16"));
        assert!(!glob(b"net-pf-1[06]", b"net-pf-17"));
        assert!(glob(b"char-major-10-2[0-9]?", b"char-major-10-200"));
        assert!(!glob(b"a?", b"a"));
    }

    #[test]
    fn a_request_resolves_through_aliases_to_a_load_order() {
        let aliases = "alias rtnl-link-bridge bridge\nalias net-pf-16-proto-12 nfnetlink\n\
                       alias devname:net/tun tun\nalias char-major-10-200 tun\n";
        let deps = "stp llc stp\nbridge llc stp bridge\ntun tun\nnf_tables nfnetlink libcrc32c nf_tables\n";
        assert_eq!(
            resolve_alias(aliases, "rtnl-link-bridge").as_deref(),
            Some("bridge")
        );
        assert_eq!(
            resolve_alias(aliases, "char-major-10-200").as_deref(),
            Some("tun")
        );
        assert_eq!(resolve_alias(aliases, "rtnl-link-nope"), None);
        assert_eq!(
            order_of(deps, "bridge").unwrap(),
            vec!["llc", "stp", "bridge"]
        );
        assert_eq!(order_of(deps, &normalize("nf-tables")).unwrap().len(), 3);
        assert_eq!(order_of(deps, "llc"), None);
    }
}
