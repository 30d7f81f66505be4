//! kubelet's path layout as the runtime and the plugin read it
//! (`crust_handoff::kubelet`): which pod, which kubelet root, which layer
//! a mount source or publish target belongs to decides whose volume a
//! container gets. Invariants: no panic; a split puts the path back
//! together exactly; a uid filter is honoured; nothing with `.`, `..` or
//! an empty component is ever split; the volumes layer agrees with the
//! split.
#![no_main]

use crust_handoff::kubelet::{self, VOLUMES};
use libfuzzer_sys::fuzz_target;

// Input: `<path>\0<uid>` (plain text, so seeds and the dictionary work).
fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (path, uid) = text.split_once('\0').unwrap_or((text, ""));
    let any = kubelet::pod_path(path, None);
    if let Some(p) = any {
        let mut joined = format!("{}/{}/{}", p.pods_dir, p.uid, p.layer);
        if !p.rest.is_empty() {
            joined = format!("{joined}/{}", p.rest);
        }
        assert_eq!(joined, path);
        assert!(p.pods_dir.ends_with("/pods"), "{path:?}");
        for c in path.split('/').skip(1) {
            assert!(!matches!(c, "" | "." | ".."), "{path:?}");
        }
        if p.layer == VOLUMES {
            let root = p.pods_dir.strip_suffix("/pods").expect("checked");
            assert_eq!(
                kubelet::kubelet_volumes_layer(path, root),
                Some(format!("{}/{VOLUMES}", p.pod_dir())),
                "{path:?}"
            );
        }
    }
    if let Some(p) = kubelet::pod_path(path, Some(uid)) {
        assert_eq!(p.uid, uid);
        assert!(any.is_some(), "a uid match is a match: {path:?}");
    }
});
