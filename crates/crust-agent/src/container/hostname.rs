//! The pod's hostname (issue 26). A pod's containers share one UTS
//! namespace, and here the pod is the guest: the guest's hostname is the
//! pod's. The agent is not sent the OCI spec's `hostname`, but CRI
//! (containerd 1.6 and later) writes the sandbox's hostname into a file it
//! binds at `/etc/hostname` in every container of the pod (the pod's name,
//! or the node's for a hostNetwork pod, as runc pods see it). The agent
//! names the guest after that file when it creates a container.

use std::io::Read;

use crust_agent_proto::{ContainerMount, MountSource};

/// A hostname from a hostname file: its first line, if usable (1-64 bytes
/// of letters, digits, `-`, `.`; what `sethostname` and resolvers take).
pub fn parse(content: &[u8]) -> Option<String> {
    let line = content.split(|b| *b == b'\n').next()?;
    let name = std::str::from_utf8(line).ok()?.trim();
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'));
    ok.then(|| name.to_string())
}

/// Sets the guest's hostname from the container's `/etc/hostname` bind,
/// when it has one. A file without a usable name is reported and left
/// alone: the container still runs, under the guest's current name.
pub fn apply_from_binds(mounts: &[ContainerMount]) {
    let Some(share) = mounts.iter().find_map(|m| match &m.source {
        MountSource::Share(s) if m.destination == "/etc/hostname" => Some(s),
        _ => None,
    }) else {
        return;
    };
    let mut content = Vec::new();
    let read = super::share_path(share).and_then(|p| {
        std::fs::File::open(&p)
            .and_then(|f| f.take(256).read_to_end(&mut content))
            .map_err(|e| format!("{}: {e}", p.display()))
    });
    let result = read.and_then(|_| {
        let name = parse(&content).ok_or_else(|| {
            format!(
                "no usable hostname in {:?}",
                String::from_utf8_lossy(&content)
            )
        })?;
        set(&name).map_err(|e| format!("sethostname({name}): {e}"))
    });
    if let Err(e) = result {
        eprintln!("crust-agent: the pod's hostname is not applied: {e}");
    }
}

pub fn set(name: &str) -> rustix::io::Result<()> {
    rustix::system::sethostname(name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_line_if_usable() {
        assert_eq!(parse(b"web-0\n").as_deref(), Some("web-0"));
        assert_eq!(
            parse(b"node-1.example\nx").as_deref(),
            Some("node-1.example")
        );
        for bad in [&b""[..], b"\n", b"a b\n", b"x;rm\n", &[b'a'; 65], b"\xff\n"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn set_names_the_uts_namespace() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        std::thread::spawn(|| {
            crust_sys::ns::unshare(rustix::thread::UnshareFlags::NEWUTS).unwrap();
            set("web-0").unwrap();
            assert_eq!(rustix::system::uname().nodename().to_bytes(), b"web-0");
        })
        .join()
        .unwrap();
    }
}
