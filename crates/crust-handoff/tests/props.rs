//! Property tests: encodings, path rules, source lookup.

use crust_handoff::validate::{check_abs_path, check_options};
use crust_handoff::{Layout, MountInfo, Policy, Store, kata_key};
use proptest::prelude::*;

fn any_mount_info() -> impl Strategy<Value = MountInfo> {
    (
        any::<String>(),
        any::<String>(),
        any::<String>(),
        prop::collection::btree_map(any::<String>(), any::<String>(), 0..4),
        prop::collection::vec(any::<String>(), 0..4),
    )
        .prop_map(
            |(volume_type, device, fstype, metadata, options)| MountInfo {
                volume_type,
                device,
                fstype,
                metadata,
                options,
            },
        )
}

fn component() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_~.-]{1,12}".prop_filter("not . or ..", |c| c != "." && c != "..")
}

proptest! {
    /// Any record, however odd its strings, survives encode -> decode, and
    /// the encoding is valid compact JSON with Kata's key order.
    #[test]
    fn mount_info_round_trips(mi in any_mount_info()) {
        let json = mi.to_json();
        prop_assert_eq!(MountInfo::from_json(json.as_bytes()).unwrap(), mi.clone());
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(v["volume-type"].as_str().unwrap(), mi.volume_type.as_str());
        prop_assert!(!json.contains('<') && !json.contains('>') && !json.contains('&'));
        prop_assert!(!json.contains('\n'));
        prop_assert_eq!(json.contains("\"metadata\""), !mi.metadata.is_empty());
        prop_assert_eq!(json.contains("\"options\""), !mi.options.is_empty());
    }

    /// For plain strings, Go's encoding is what serde_json writes for the
    /// same object with the same key order.
    #[test]
    fn plain_strings_encode_like_compact_json(
        dev in "/dev/[a-z0-9]{1,8}",
        gid in any::<u32>(),
        opts in prop::collection::vec("[a-z0-9=]{1,10}", 0..3),
    ) {
        let mut mi = MountInfo::block(dev.clone(), "xfs");
        mi.set_fs_group(Some(gid));
        mi.options = opts.clone();
        let mut expected = format!(
            r#"{{"volume-type":"block","device":{},"fstype":"xfs","metadata":{{"fsGroup":"{gid}"}}"#,
            serde_json::to_string(&dev).unwrap()
        );
        if !opts.is_empty() {
            expected.push_str(&format!(r#","options":{}"#, serde_json::to_string(&opts).unwrap()));
        }
        expected.push('}');
        prop_assert_eq!(mi.to_json(), expected);
    }

    /// Joined clean components are accepted; any `.`, `..`, `//` or a
    /// trailing slash spliced in is refused.
    #[test]
    fn path_normalization(comps in prop::collection::vec(component(), 1..8), at in any::<prop::sample::Index>(), bad in 0usize..4) {
        let good = format!("/{}", comps.join("/"));
        prop_assert!(check_abs_path("p", &good).is_ok());
        let mut parts = comps.clone();
        let i = at.index(parts.len() + 1);
        let spliced = match bad {
            0 => { parts.insert(i, ".".into()); format!("/{}", parts.join("/")) }
            1 => { parts.insert(i, "..".into()); format!("/{}", parts.join("/")) }
            2 => { parts.insert(i, "".into()); format!("/{}", parts.join("/")) }
            _ => format!("{good}/"),
        };
        prop_assert!(check_abs_path("p", &spliced).is_err(), "{}", spliced);
    }

    /// Base64 keys decode back to the path and only use the URL-safe alphabet.
    #[test]
    fn kata_keys_are_url_safe(path in "/[ -~]{0,100}") {
        let k = kata_key(&path);
        prop_assert!(k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'='));
        prop_assert_eq!(k.len() % 4, 0);
        use base64::Engine;
        prop_assert_eq!(base64::engine::general_purpose::URL_SAFE.decode(&k).unwrap(), path.as_bytes());
    }

    /// Options with a credential marker anywhere, in any case, never pass.
    #[test]
    fn credential_options_never_pass(pre in "[a-z0-9_]{0,6}", marker in prop::sample::select(vec!["password", "passwd", "pass=", "secret", "cred", "token", "key=", "username=", "user=", "auth"]), post in "[a-z0-9=]{0,6}", upper in any::<bool>()) {
        let mut o = format!("{pre}{marker}{post}");
        if upper { o = o.to_uppercase(); }
        prop_assert!(check_options(&[o]).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the depth of the target below the stop layer and of the
    /// subpath below the target, the lookup finds the target and returns
    /// exactly the subpath.
    #[test]
    fn find_for_source_returns_target_and_subpath(
        below in prop::collection::vec(component(), 1..4),
        sub in prop::collection::vec(component(), 0..4),
        kata in any::<bool>(),
    ) {
        let dev = std::fs::read_dir("/dev").unwrap().filter_map(|e| e.ok())
            .find(|e| { use std::os::unix::fs::FileTypeExt; e.file_type().map(|t| t.is_block_device()).unwrap_or(false) })
            .unwrap().path();
        let tmp = tempfile::tempdir().unwrap();
        let layout = if kata { Layout::Kata } else { Layout::Crust };
        let store = Store::new(layout, tmp.path().join("r"), Policy::default()).unwrap();
        let layer = "/var/lib/kubelet/pods/u1/volumes";
        let target = format!("{layer}/{}", below.join("/"));
        store.stage(&target, &MountInfo::block(dev.to_str().unwrap(), "ext4")).unwrap();
        let source = if sub.is_empty() { target.clone() } else { format!("{target}/{}", sub.join("/")) };
        let m = store.find_for_source(&source, layer).unwrap().unwrap();
        prop_assert_eq!(m.target, target);
        prop_assert_eq!(m.subpath, sub.join("/"));
    }
}
