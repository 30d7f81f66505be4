//! Points at which a test makes the plugin die (SIGKILL), named by the
//! test-only variables that select them.

/// Points of a handover at which a test makes the plugin die (SIGKILL),
/// set through the test-only `CRUST_CSI_TEST_HANDOVER_CRASH` variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoverStep {
    Recorded,
    TargetUnmounted,
    StagingUnmounted,
    RecordWritten,
    PlaceholderMounted,
}

impl HandoverStep {
    pub const ALL: [HandoverStep; 5] = [
        HandoverStep::Recorded,
        HandoverStep::TargetUnmounted,
        HandoverStep::StagingUnmounted,
        HandoverStep::RecordWritten,
        HandoverStep::PlaceholderMounted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HandoverStep::Recorded => "recorded",
            HandoverStep::TargetUnmounted => "target-unmounted",
            HandoverStep::StagingUnmounted => "staging-unmounted",
            HandoverStep::RecordWritten => "record-written",
            HandoverStep::PlaceholderMounted => "placeholder-mounted",
        }
    }

    pub fn parse(s: &str) -> Option<HandoverStep> {
        HandoverStep::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

/// Points of a host publish at which a test makes the plugin die
/// (SIGKILL), set through the test-only `CRUST_CSI_TEST_PUBLISH_CRASH`
/// variable: the crash windows an unpublish must clean up after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishStep {
    /// The record lists the target as the plugin's; it does not exist yet.
    TargetRecorded,
    /// The target exists; nothing is bound on it.
    TargetCreated,
    /// The bind is in place; the publication is not recorded.
    Bound,
}

impl PublishStep {
    pub fn parse(s: &str) -> Option<PublishStep> {
        match s {
            "target-recorded" => Some(PublishStep::TargetRecorded),
            "target-created" => Some(PublishStep::TargetCreated),
            "bound" => Some(PublishStep::Bound),
            _ => None,
        }
    }
}
