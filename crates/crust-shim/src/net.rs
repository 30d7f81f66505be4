//! containerd's view of a pod's network: the event a refusal publishes
//! (the network itself is crust-sandbox's `net`).

use crust_podnet::NetError;

/// containerd event topic of a pod refused for the netfilter rules in its
/// namespace: a JSON `google.protobuf.StringValue` naming them.
pub const NETFILTER_TOPIC: &str = "/crust/network/netfilter-rules";

/// The [`NETFILTER_TOPIC`] event's body for a refusal, if `e` is one.
pub fn rules_event(pod: &str, e: &NetError) -> Option<String> {
    let (NetError::Rules { path, found } | NetError::Uncarried { path, found, .. }) = e else {
        return None;
    };
    let rules: Vec<serde_json::Value> = found
        .iter()
        .map(|f| {
            serde_json::json!({"backend": f.backend, "table": f.table, "chain": f.chain,
                "rules": f.rules, "policy": f.policy})
        })
        .collect();
    Some(
        serde_json::json!({"sandbox_id": pod, "netns": path, "action": "refused",
            "rules": rules, "reason": e.to_string()})
        .to_string(),
    )
}
