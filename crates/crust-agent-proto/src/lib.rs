//! crust-agent-proto
