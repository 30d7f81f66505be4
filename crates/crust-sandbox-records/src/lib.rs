//! What the runtime persists and what other processes read as data: a
//! sandbox's state file, the deferred volumes and mounts it consumes, the
//! handover events it keeps, the annotations it reads. These modules
//! import no service (discovery, sandbox store, shim, volumes…); the
//! services import them. A change to a persisted format starts here.

mod accel;
mod annotations;
mod event;
mod sandbox;
mod volume;

pub use accel::{AccelChoice, ResolvedAccel};
pub use annotations::DEFER_ANNOTATION;
pub use event::{HANDED_OVER, ON_HOST, VolumeEvent};
pub use sandbox::{
    OCI_VERSION, ProcRef, SandboxState, SharedMount, Status, VolumeIo, proc_start_time,
};
pub use volume::{LayoutKind, Volume, WorkloadMount, volume_id};
