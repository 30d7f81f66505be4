//! A volume's data history as records keep it (the decisions built on it
//! are in `crate::history`).

use serde::{Deserialize, Serialize};

use crate::caps::FsType;

/// What crust knows of who wrote a volume's bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// Staged as raw block at least once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_block_used: bool,
    /// A filesystem crust created (or started to create) on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formatted: Option<FsType>,
    /// A guest had raw access to its filesystem.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub guest_had_it: bool,
}

impl History {
    /// Nothing but crust's own empty store: a copy of it is blank too.
    pub fn is_pristine(&self) -> bool {
        *self == History::default()
    }
}

/// Where a copy's data came from and what was known of it then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inherited {
    pub from: SourceRecord,
    /// `None`: the source's history could not be found (a snapshot cut
    /// before histories were kept, or its record lost): never formatted.
    pub history: Option<History>,
}

/// A volume's content source, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceRecord {
    Snapshot(String),
    Volume(String),
}

impl From<&crust_backend::ContentSource> for SourceRecord {
    fn from(s: &crust_backend::ContentSource) -> Self {
        match s {
            crust_backend::ContentSource::Snapshot(id) => SourceRecord::Snapshot(id.clone()),
            crust_backend::ContentSource::Volume(id) => SourceRecord::Volume(id.clone()),
        }
    }
}

impl SourceRecord {
    pub fn to_proto(&self) -> crust_proto::csi::v1::VolumeContentSource {
        use crust_proto::csi::v1::volume_content_source::{SnapshotSource, Type, VolumeSource};
        crust_proto::csi::v1::VolumeContentSource {
            r#type: Some(match self {
                SourceRecord::Snapshot(id) => Type::Snapshot(SnapshotSource {
                    snapshot_id: id.clone(),
                }),
                SourceRecord::Volume(id) => Type::Volume(VolumeSource {
                    volume_id: id.clone(),
                }),
            }),
        }
    }
}
