//! Where errors become ttrpc statuses, and the event timestamps.

use std::time::SystemTime;

use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::ttrpc;
use crust_sandbox::shim::Code;

use crate::pod::PodError;
use crust_sandbox::spec;

pub(super) fn status(code: ttrpc::Code, msg: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg.into()))
}

/// One place where error classes become ttrpc codes.
pub(super) fn code_of(c: Code) -> ttrpc::Code {
    match c {
        Code::InvalidArgument => ttrpc::Code::INVALID_ARGUMENT,
        Code::NotFound => ttrpc::Code::NOT_FOUND,
        Code::AlreadyExists => ttrpc::Code::ALREADY_EXISTS,
        Code::FailedPrecondition => ttrpc::Code::FAILED_PRECONDITION,
        Code::OutOfRange => ttrpc::Code::OUT_OF_RANGE,
        Code::Unavailable => ttrpc::Code::UNAVAILABLE,
        Code::DeadlineExceeded => ttrpc::Code::DEADLINE_EXCEEDED,
        Code::Internal => ttrpc::Code::INTERNAL,
    }
}

impl From<PodError> for ttrpc::Error {
    fn from(e: PodError) -> ttrpc::Error {
        status(code_of(e.code()), e.to_string())
    }
}

pub(super) fn spec_err(e: spec::SpecError) -> ttrpc::Error {
    status(code_of(e.code()), e.to_string())
}

pub(super) fn agent_err(
    what: &str,
) -> impl FnOnce(crust_agent_proto::ClientError) -> ttrpc::Error + '_ {
    move |e| {
        status(
            code_of(crust_sandbox::shim::agent_code(&e)),
            format!("{what}: {e}"),
        )
    }
}

pub(super) fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let mut ts = Timestamp::new();
    ts.seconds = d.as_secs() as i64;
    ts.nanos = d.subsec_nanos() as i32;
    ts
}
