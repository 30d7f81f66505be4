//! A volume's data history, and the one decision built on it: may
//! NodeStageVolume format this volume?
//!
//! crust formats a device only when it can prove the device holds no data
//! crust did not write itself (docs/security.md). What a probe of the
//! device cannot see, the records must know: whether the volume was ever
//! used as raw block (such data need carry no signature), whether crust
//! formatted it before, whether a guest had it. That [`History`] travels
//! with every copy: a clone takes its source's, a snapshot keeps its
//! source's as of the cut (`<state-dir>/snapshots/<id>.json`) and hands it
//! to every restore. A copy whose history cannot be found is never
//! formatted. A volume that is not a copy asks its backend
//! ([`crust_backend::Blankness`]): a pool file made empty, a static device
//! declared blank, released by DeleteVolume, or read in full and found zero.

use crust_backend::Blankness;
use crust_blockdev::BlankProof;

use crate::caps::FsType;
use crate::error::{NodeError, StageError};
use crate::records::{History, Inherited};
use crate::records::{SourceRecord, VolumeRecord};

impl VolumeRecord {
    /// This volume's history as of now (what a snapshot or clone keeps).
    pub fn history(&self) -> History {
        let inherited = self
            .inherited
            .as_ref()
            .and_then(|i| i.history.clone())
            .unwrap_or_default();
        History {
            raw_block_used: self.raw_block_used || inherited.raw_block_used,
            formatted: self
                .formatted
                .or(self.format_started)
                .or(inherited.formatted),
            guest_had_it: self.returned.is_some() || inherited.guest_had_it,
        }
        // A copy of unknown history passes that on: see `inherit`.
    }

    /// Whether the history of this volume's data is known (a copy whose
    /// source history was lost is not, nor is any copy of it).
    pub fn history_known(&self) -> bool {
        match (&self.content_source, &self.inherited) {
            (None, _) => true,
            (Some(_), Some(i)) => i.history.is_some(),
            // A copy made before histories were kept.
            (Some(_), None) => false,
        }
    }

    /// Makes this new copy carry `source`'s history (`None`: unknown).
    pub fn inherit(&mut self, from: SourceRecord, history: Option<History>) {
        if let Some(h) = &history {
            self.raw_block_used |= h.raw_block_used;
            self.formatted = self.formatted.or(h.formatted);
            if h.guest_had_it && self.returned.is_none() {
                // The host mounts it only after a userspace check.
                self.returned = Some(crate::records::Returned::now(""));
            }
        }
        self.inherited = Some(Inherited { from, history });
    }
}

/// The proof the format gate ([`crust_blockdev::format`]) needs for
/// NodeStageVolume to create `fs` on `rec`'s device, which probed blank;
/// or why it must not. `blankness` asks the backend, only for a volume
/// that is not a copy.
pub fn format_proof(
    rec: &VolumeRecord,
    fs: FsType,
    blankness: impl FnOnce() -> Result<Blankness, NodeError>,
) -> Result<BlankProof, NodeError> {
    let refuse = |found: String| -> NodeError {
        StageError::WouldOverwrite {
            volume: rec.id.clone(),
            found,
            refused: format!("create {fs} on it"),
        }
        .into()
    };
    if rec.raw_block_used {
        return Err(refuse(
            "was used as a raw block device (itself or the volume it was copied from): its data \
             need not carry any signature, so it is never formatted"
                .into(),
        ));
    }
    if let Some(done) = rec.formatted {
        return Err(StageError::WouldOverwrite {
            volume: rec.id.clone(),
            found: format!(
                "was formatted with {done} by this plugin before (itself or the volume it was \
                 copied from) and now looks blank (wiped or replaced behind the plugin's back?)"
            ),
            refused: "format it again".into(),
        }
        .into());
    }
    if let Some(src) = &rec.content_source {
        return match rec.inherited.as_ref().and_then(|i| i.history.as_ref()) {
            Some(h) if h.is_pristine() => Ok(BlankProof::Recorded(format!(
                "a copy of {} which was never used",
                src_name(src)
            ))),
            Some(_) => Err(refuse(format!(
                "is a copy of {} whose data a workload or a guest wrote",
                src_name(src)
            ))),
            None => Err(refuse(format!(
                "is a copy of {} whose history is unknown (copied before crust kept histories, \
                 or the snapshot's record is lost): it may hold data without a signature",
                src_name(src)
            ))),
        };
    }
    match blankness()? {
        Blankness::MadeEmpty => Ok(BlankProof::Recorded(
            "the backend created the store empty and only crust wrote to it".into(),
        )),
        Blankness::Declared { device, setting } => Ok(BlankProof::Recorded(format!(
            "the operator declared {} blank ({setting})",
            device.display()
        ))),
        Blankness::Released { device, volume } => Ok(BlankProof::Recorded(format!(
            "crust zeroed {} whole when DeleteVolume released volume {volume}",
            device.display()
        ))),
        Blankness::ReadAllZero { device } => Ok(BlankProof::Recorded(format!(
            "a full read of {} found only zeros",
            device.display()
        ))),
        Blankness::Scanning {
            device,
            done_bytes,
            total_bytes,
        } => Err(StageError::BlankCheckRunning {
            volume: rec.id.clone(),
            device,
            done_bytes,
            total_bytes,
        }
        .into()),
        Blankness::HoldsData {
            device,
            offset,
            setting,
        } => Err(refuse(format!(
            "is on {}, which holds data without any signature (a full read found a non-zero \
             byte at offset {offset}); if the device really is free, wipe it or declare it \
             blank with {setting} {}",
            device.display(),
            device.display()
        ))),
        // The pool says Copy also for entries from before it recorded how
        // a store was made; this volume's record (which has always kept a
        // content source) says it was created empty.
        Blankness::Copy => Ok(BlankProof::Recorded(
            "the plugin's record says the volume was created empty (its pool entry predates \
             the pool's own record of that)"
                .into(),
        )),
        Blankness::Unknown => Err(refuse(
            "is on a store whose backend cannot prove it holds no data".into(),
        )),
    }
}

fn src_name(src: &SourceRecord) -> String {
    match src {
        SourceRecord::Snapshot(id) => format!("snapshot {id}"),
        SourceRecord::Volume(id) => format!("volume {id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> VolumeRecord {
        crate::state::tests_support::record("v")
    }

    fn ok_backend() -> Result<Blankness, NodeError> {
        Ok(Blankness::MadeEmpty)
    }

    #[test]
    fn history_and_refusals() {
        let r = rec();
        assert!(matches!(
            format_proof(&r, FsType::Ext4, ok_backend),
            Ok(BlankProof::Recorded(_))
        ));
        let mut raw = rec();
        raw.raw_block_used = true;
        assert!(
            format_proof(&raw, FsType::Ext4, ok_backend)
                .unwrap_err()
                .to_string()
                .contains("raw block")
        );

        // A copy of a raw-used volume inherits the refusal.
        let mut copy = rec();
        copy.content_source = Some(SourceRecord::Volume("src".into()));
        copy.inherit(SourceRecord::Volume("src".into()), Some(raw.history()));
        assert!(copy.raw_block_used);
        assert!(format_proof(&copy, FsType::Ext4, ok_backend).is_err());

        // A copy of a pristine volume is blank by proof.
        let mut copy = rec();
        copy.content_source = Some(SourceRecord::Snapshot("s".into()));
        copy.inherit(SourceRecord::Snapshot("s".into()), Some(History::default()));
        assert!(format_proof(&copy, FsType::Ext4, || panic!("not asked")).is_ok());

        // Unknown history: never.
        let mut copy = rec();
        copy.content_source = Some(SourceRecord::Snapshot("s".into()));
        copy.inherit(SourceRecord::Snapshot("s".into()), None);
        let e = format_proof(&copy, FsType::Ext4, ok_backend).unwrap_err();
        assert!(e.to_string().contains("history is unknown"), "{e}");
        assert!(!copy.history_known());

        // A formatted source's copy that looks blank is not formatted again.
        let mut f = rec();
        f.formatted = Some(FsType::Ext4);
        let mut copy = rec();
        copy.content_source = Some(SourceRecord::Volume("f".into()));
        copy.inherit(SourceRecord::Volume("f".into()), Some(f.history()));
        assert_eq!(copy.formatted, Some(FsType::Ext4));
        assert!(format_proof(&copy, FsType::Ext4, ok_backend).is_err());
    }

    #[test]
    fn backend_verdicts() {
        let r = rec();
        let dev = std::path::PathBuf::from("/dev/sdx");
        let scanning = format_proof(&r, FsType::Ext4, || {
            Ok(Blankness::Scanning {
                device: dev.clone(),
                done_bytes: 1,
                total_bytes: 2,
            })
        })
        .unwrap_err();
        assert_eq!(tonic::Status::from(scanning).code(), tonic::Code::Aborted);
        let data = format_proof(&r, FsType::Ext4, || {
            Ok(Blankness::HoldsData {
                device: dev.clone(),
                offset: 50 << 20,
                setting: "--static-device-blank",
            })
        })
        .unwrap_err();
        let s = tonic::Status::from(data);
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(s.message().contains("/dev/sdx"), "{}", s.message());
        assert!(
            s.message().contains("--static-device-blank"),
            "{}",
            s.message()
        );
        assert!(format_proof(&r, FsType::Ext4, || Ok(Blankness::Unknown)).is_err());
        // An old pool entry: the record, not a copy, decides.
        assert!(format_proof(&r, FsType::Ext4, || Ok(Blankness::Copy)).is_ok());
    }
}
