//! crust-agent
