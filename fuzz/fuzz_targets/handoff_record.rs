//! The hand-off record reader, both layouts, as the runtime and the
//! plugin call it on a record some root process wrote: a record directory
//! is laid out on a tmpfs with the fuzzed mountInfo.json, runtime-cli and
//! sandbox file, then read through Store::read, inspect, list and
//! find_for_source. Input: a header byte (bit 0: Kata layout, bit 1: a
//! runtime-cli file, bit 2: a sandbox file), then mountInfo.json, and
//! after a NUL byte the runtime-cli contents.
//! Invariants: no panic; every reader agrees; an accepted record passes
//! the write-side format, re-encodes to bytes that parse to itself.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use arbitrary::Unstructured;
use crust_handoff::{Layout, MountInfo, Policy, Store};
use libfuzzer_sys::fuzz_target;

/// A target under the policy's prefix, and where its record lives.
const TARGET: &str = "/var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pv/mount";
const PREFIX: &str = "/var/lib/kubelet/pods";
/// The regular file the seeds name as their device (a file-device root).
const DEVICE: &str = "/dev/shm/crust-fuzz-handoff/images/disk.img";

struct Roots {
    crust: Store,
    kata: Store,
}

fn roots() -> &'static Roots {
    static R: OnceLock<Roots> = OnceLock::new();
    R.get_or_init(|| {
        let base = Path::new("/dev/shm/crust-fuzz-handoff");
        std::fs::create_dir_all(base.join("images")).unwrap();
        std::fs::write(DEVICE, b"").unwrap();
        let policy = Policy {
            allowed_target_prefixes: vec![PREFIX.into()],
            file_device_roots: vec![base.join("images")],
            ..Policy::default()
        };
        // Record roots: scripts/fuzz.sh gives each run its own scratch
        // directory and removes it; by hand, one root per process.
        let scratch =
            std::env::var_os("CRUST_FUZZ_SCRATCH").map_or(base.to_path_buf(), PathBuf::from);
        let store = |name: &str, layout| {
            let root = scratch.join(format!("{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir(&root).unwrap();
            Store::new(layout, root, policy.clone()).unwrap()
        };
        Roots {
            crust: store("crust", Layout::Crust),
            kata: store("kata", Layout::Kata),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let head = u.arbitrary::<u8>().unwrap_or(0);
    let rest = u.take_rest();
    let (record, cli) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let r = roots();
    let store = if head & 1 == 0 { &r.crust } else { &r.kata };
    let dir: PathBuf = store.root().join(store.layout().key(TARGET));
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("mountInfo.json"), record).unwrap();
    if head & 2 != 0 {
        std::fs::write(dir.join("runtime-cli"), cli).unwrap();
    }
    if head & 4 != 0 {
        std::fs::write(dir.join("sb-1"), b"").unwrap();
    }

    let read = store.read(TARGET);
    let inspect = store.inspect(TARGET);
    let listed = store.list().unwrap();
    let found = store.find_for_source(&format!("{TARGET}/sub/dir"), PREFIX);
    std::fs::remove_dir_all(&dir).unwrap();

    // Direct parse: the same verdict on the JSON as the store's.
    let parsed = MountInfo::from_json(record);
    if parsed.is_err() {
        assert!(read.is_err());
    }
    assert_eq!(listed.len(), 1);
    match &read {
        Ok(mi) => {
            assert_eq!(parsed.as_ref(), Ok(mi));
            if let Ok(st) = &inspect {
                assert_eq!(&st.mount_info, mi);
            }
            let m = found.expect("found").expect("a record");
            assert_eq!((m.target.as_str(), m.subpath.as_str()), (TARGET, "sub/dir"));
            assert_eq!(&m.mount_info, mi);
            // Go's bytes of what was read parse back to the same record.
            assert_eq!(
                MountInfo::from_json(mi.to_json().as_bytes()).as_ref(),
                Ok(mi)
            );
        }
        Err(_) => {
            assert!(inspect.is_err());
            assert!(listed[0].state.is_err());
            assert!(found.is_err());
        }
    }
});
