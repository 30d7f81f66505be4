//! Every mountinfo parser in the tree that is reachable without the
//! runtime: crust-mountinfo's (through crust-blockdev: the plugin and the
//! runtime on the host; the test kit) and
//! the guest agent's. Invariants: no panic; on a table the host parser
//! accepts, the agent's parser sees the same mounts (ids, devices, mount
//! points), so an octal escape means the same to both.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let host = crust_blockdev::mount::parse_mountinfo(data);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let guest = crust_agent::sys::parse_mountinfo(text);
    // The host parser refuses a line the agent's skips; `lines()` also
    // strips a `\r` the host keeps.
    let Ok(host) = host else { return };
    if text.contains('\r') {
        return;
    }
    assert_eq!(host.len(), guest.len(), "{text:?}");
    for (h, g) in host.iter().zip(&guest) {
        assert_eq!(u64::from(h.mount_id), g.identity.id);
        assert_eq!((h.major, h.minor), g.identity.dev);
        if let Some(p) = h.mount_point.to_str() {
            assert_eq!(std::path::Path::new(p), g.mount_point, "{text:?}");
        }
    }
});
