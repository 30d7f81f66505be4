//! Every mountinfo parser in the tree that is reachable without the
//! runtime: crust-mountinfo's, whole-table (`parse`, through
//! crust-blockdev: the plugin and the runtime on the host; the test kit)
//! and line by line (`entries`, which the guest agent maps into its own
//! entries). Invariants: no panic; `parse` is `entries` with the first
//! refused line kept as the error; the agent sees exactly the lines
//! `entries` accepts, with the same ids, devices, mount points (byte for
//! byte), sources, types and read-only verdicts.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let lines: Vec<_> = crust_mountinfo::entries(data).collect();
    let whole = crust_mountinfo::parse(data);
    match lines.iter().find_map(|r| r.as_ref().err()) {
        Some(first) => assert_eq!(whole.as_ref().err(), Some(first)),
        None => {
            let ok: Vec<_> = lines.iter().flatten().cloned().collect();
            assert_eq!(whole.as_ref().ok(), Some(&ok));
        }
    }
    // The host's reader keeps the verdict (its error only re-worded).
    assert_eq!(
        crust_blockdev::mount::parse_mountinfo(data).is_ok(),
        whole.is_ok()
    );
    let guest = crust_agent::sys::parse_mountinfo(data);
    let host: Vec<_> = lines.iter().flatten().collect();
    assert_eq!(host.len(), guest.len());
    for (h, g) in host.iter().zip(&guest) {
        assert_eq!(u64::from(h.mount_id), g.identity.id);
        assert_eq!((h.major, h.minor), g.identity.dev);
        assert_eq!(h.mount_point, g.mount_point);
        assert_eq!((&h.source, &h.fs_type), (&g.source, &g.fstype));
        assert_eq!(h.is_read_only() || h.super_read_only(), g.is_readonly());
    }
});
