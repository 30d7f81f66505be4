//! The format gate: the one routine through which crust writes a new
//! filesystem over a device (NodeStageVolume, Kata's `createFilesystem`,
//! test fixtures alike).
//!
//! The invariant it keeps (docs/security.md): **crust formats a device
//! only when it can prove the device holds no data crust did not write
//! itself.** A probe cannot prove that on its own: a raw block volume's
//! data, or a disk written only in its middle, carries no signature for
//! [`probe_fs`] to find. So every caller states its proof as a
//! [`BlankProof`]; the gate checks what can be checked (nobody has the
//! device, no signature or non-zero edge, and for [`BlankProof::ReadNow`]
//! every byte zero) before the tool runs.

use std::path::Path;

use crate::fs::{FsError, FsType, make_fs};
use crate::probe::{Probe, probe_fs};

/// Why the caller may overwrite what the device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlankProof {
    /// The caller's own records prove it (a pool file crust created empty
    /// and nobody used; a copy of such a volume; a device the operator
    /// declared blank; a full read recorded earlier). The string says
    /// which, for the log line.
    Recorded(String),
    /// No records to go by: the gate reads the whole device and formats
    /// only if every byte is zero. Costs one full read.
    ReadNow,
    /// The caller recorded that it found the device blank and started
    /// formatting it, and nothing used the device since: the half-made
    /// filesystem its interrupted format left is overwritten.
    RedoOwnFormat,
}

impl std::fmt::Display for BlankProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlankProof::Recorded(why) => f.write_str(why),
            BlankProof::ReadNow => f.write_str("a full read found only zeros"),
            BlankProof::RedoOwnFormat => f.write_str("redoing an interrupted format of its own"),
        }
    }
}

/// Creates a `fs` filesystem on `dev` if `proof` holds; see the module
/// doc. Refuses a device that is mounted or open elsewhere
/// ([`FsError::InUse`], [`FsError::OpenElsewhere`]), whose data another
/// device exposes ([`FsError::Aliased`]), one that is not
/// [`Probe::Blank`] ([`FsError::NotBlank`], except for
/// [`BlankProof::RedoOwnFormat`]) and, for [`BlankProof::ReadNow`], one
/// with any non-zero byte ([`FsError::HoldsData`]).
pub fn format(dev: &Path, fs: FsType, proof: &BlankProof) -> Result<(), FsError> {
    make_fs(dev, fs, |dev| {
        // A format is a host write like a mount: never through one of two
        // devices showing the same data.
        crate::alias::ensure_no_aliases(dev, "format it")?;
        if *proof == BlankProof::RedoOwnFormat {
            return Ok(());
        }
        let found = probe_fs(dev)?;
        if found != Probe::Blank {
            return Err(FsError::NotBlank {
                device: dev.to_path_buf(),
                found,
            });
        }
        if *proof == BlankProof::ReadNow
            && let Some(offset) = crate::zeros::first_data_offset(dev, &mut |_, _| {})?
        {
            return Err(FsError::HoldsData {
                device: dev.to_path_buf(),
                offset,
            });
        }
        Ok(())
    })?;
    tracing::info!(device = %dev.display(), %fs, proof = %proof, "filesystem created");
    Ok(())
}

/// Creates a filesystem on a block device that must be provably blank:
/// [`crate::format`] with [`BlankProof::ReadNow`] (no signature, zero
/// edges, and a full read finds only zeros). For callers without records
/// of the device (tests, tools); the plugin passes its records' proof to
/// [`crate::format`] instead.
///
/// Runs the filesystem's [`crust_fs::FsSpec::mkfs`]:
///
/// * ext4: `mkfs.ext4 -F -q -e remount-ro -E lazy_itable_init=1,lazy_journal_init=1,nodiscard`
///   (lazy init keeps formatting small test volumes and large sparse files
///   fast; `errors=remount-ro` makes the kernel flip the filesystem
///   read-only on corruption, which [`crate::fs_health`] reports).
/// * xfs: `mkfs.xfs -f -q -K` (no discard). xfsprogs ≥ 5.19 refuses
///   filesystems smaller than 300 MiB; the tool's message is returned.
pub fn mkfs(dev: &Path, fstype: FsType) -> Result<(), FsError> {
    format(dev, fstype, &BlankProof::ReadNow)
}
