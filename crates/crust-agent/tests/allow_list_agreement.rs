//! The CSI plugin refuses exactly what the guest would refuse (issue 11
//! item 1, brought by issue 10): for generated mount-option lists, the
//! plugin's check (`crust_blockdev::parse_mount_options`, used at
//! CreateVolume, NodeStage/Publish and by crust_ops) and the guest agent's
//! (`crust_agent::options::parse`) agree, and whatever the plugin accepts,
//! written into a hand-off record one option per entry and handed to the
//! guest the way the runtime does (`ro`/`rw` as the readonly flag), mounts
//! with the same flags and data in the guest. Budget: < 1 s.

use crust_agent_proto::FsType;
use proptest::prelude::*;

/// Option words: every name the tables know, a few they do not, with
/// values in and out of the kernel's bounds.
fn word() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(vec![
        "ro",
        "rw",
        "defaults",
        "noatime",
        "relatime",
        "strictatime",
        "nodiratime",
        "lazytime",
        "sync",
        "dirsync",
        "nosuid",
        "suid",
        "nodev",
        "dev",
        "noexec",
        "exec",
        "nosymfollow",
        "bind",
        "rbind",
        "remount",
        "loop",
        "dax",
        "user",
        "nofail",
        "_netdev",
        "discard",
        "nodiscard",
        "usrquota",
        "grpquota",
        "prjquota",
        "quota",
        "noquota",
        "grpid",
        "norecovery",
        "barrier",
        "nobarrier",
        "data",
        "errors",
        "commit",
        "journal_checksum",
        "journal_ioprio",
        "auto_da_alloc",
        "init_itable",
        "noload",
        "nombcache",
        "resuid",
        "resgid",
        "stripe",
        "max_batch_time",
        "inode_readahead_blks",
        "max_dir_size_kb",
        "journal_path",
        "logdev",
        "inode64",
        "logbufs",
        "logbsize",
        "allocsize",
        "sunit",
        "swidth",
        "nouuid",
        "attr2",
        "ikeep",
        "uquota",
        "context",
        "frobnicate",
        "",
    ]);
    let values = prop::sample::select(vec![
        None,
        Some("0"),
        Some("1"),
        Some("7"),
        Some("8"),
        Some("30"),
        Some("2147483"),
        Some("2147484"),
        Some("99999999999999999999"),
        Some("-1"),
        Some("64k"),
        Some("48k"),
        Some("256k"),
        Some("1g"),
        Some("2g"),
        Some("1073741824"),
        Some("ordered"),
        Some("journal"),
        Some("remount-ro"),
        Some("panic"),
        Some("/dev/sda"),
        Some("x"),
        Some(""),
    ]);
    (keys, values).prop_map(|(k, v)| match v {
        Some(v) => format!("{k}={v}"),
        None => k.to_string(),
    })
}

fn element() -> impl Strategy<Value = String> {
    prop::collection::vec(word(), 1..3).prop_map(|w| w.join(","))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn plugin_and_guest_agree(opts in prop::collection::vec(element(), 0..4), ro: bool, xfs: bool) {
        let fs = if xfs { FsType::Xfs } else { FsType::Ext4 };
        let plugin = crust_blockdev::parse_mount_options(fs, &opts, ro);
        let guest = crust_agent::options::parse(fs, &opts, ro);
        prop_assert_eq!(plugin.is_ok(), guest.is_ok(), "{:?} ro={}: plugin {:?} guest {:?}", opts, ro, plugin, guest);
        if let Ok(p) = plugin {
            // What crust_ops writes into the record, and what the runtime
            // then sends the agent.
            let words = crust_fs::options::parse(fs, &opts, ro).unwrap().words;
            let readonly = ro || words.iter().any(|w| w == "ro");
            let sent: Vec<String> = words.into_iter().filter(|w| w != "ro" && w != "rw").collect();
            let g = crust_agent::options::parse(fs, &sent, readonly);
            prop_assert!(g.is_ok(), "{:?} -> {:?}: {:?}", opts, sent, g);
            let g = g.unwrap();
            prop_assert_eq!(g.data, p.data);
            prop_assert_eq!(g.flags, p.flags);
            prop_assert_eq!(g.readonly, p.read_only);
        }
    }
}
