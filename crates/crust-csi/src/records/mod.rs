//! What the plugin persists and what crosses its boundaries as data: the
//! volume record and its parts, the handover record, a volume's data
//! history, the test-only crash points. These modules import no service
//! (controller, node, handover, snapshot…); the services and the state
//! store import them. A change to a persisted format starts here.

mod crash;
mod handover;
mod history;
mod volume;

pub use crash::{HandoverStep, PublishStep};
pub use handover::{HandoverPhase, HandoverRecord, Returned, SubpathBind};
pub use history::{History, Inherited, SourceRecord};
pub use volume::{
    DEFER_CONTEXT_KEY, HostMount, Phase, Publication, RECORD_VERSION, Staging, VolumeRecord,
    is_valid_volume_id, volume_id_for,
};
