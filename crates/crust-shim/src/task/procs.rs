//! The containers of the pod and their processes, as the task service
//! tracks them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crust_agent_proto::ProcessSpec;
use tokio::sync::watch;

use crate::io::{Relay, StdioPaths};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Created,
    Running,
    Stopped,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Exit {
    pub(super) code: u32,
    pub(super) at: SystemTime,
}

/// A container's init or exec process.
pub(super) struct Proc {
    pub(super) exec_id: String,
    pub(super) stream: u32,
    pub(super) paths: StdioPaths,
    /// For an exec: what to run at Start.
    pub(super) spec: Option<ProcessSpec>,
    pub(super) state: Mutex<State>,
    pub(super) exit: watch::Sender<Option<Exit>>,
    pub(super) relay: tokio::sync::Mutex<Option<Relay>>,
}

impl Proc {
    pub(super) fn new(
        exec_id: &str,
        stream: u32,
        paths: StdioPaths,
        spec: Option<ProcessSpec>,
        relay: Relay,
    ) -> Arc<Proc> {
        Arc::new(Proc {
            exec_id: exec_id.to_string(),
            stream,
            paths,
            spec,
            state: Mutex::new(State::Created),
            exit: watch::channel(None).0,
            relay: tokio::sync::Mutex::new(Some(relay)),
        })
    }

    pub(super) fn state(&self) -> State {
        *self.state.lock().expect("state")
    }

    pub(super) fn exited(&self) -> Option<Exit> {
        *self.exit.borrow()
    }
}

pub(super) struct Ctr {
    pub(super) id: String,
    pub(super) bundle: PathBuf,
    pub(super) owner: bool,
    pub(super) init: Arc<Proc>,
    pub(super) execs: Mutex<HashMap<String, Arc<Proc>>>,
}
