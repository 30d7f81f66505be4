//! What netfilter holds in the pod's namespace before crust joins it
//! (issue 42). The guest's frames cross the namespace below its IP
//! stack, so rules a CNI plugin or a mesh put there (istio-cni's
//! REDIRECT, a per-pod egress firewall) would never see them: a caller
//! refuses the pod, or says it ignores them, naming what [`inspect`]
//! found.
//!
//! "Rules" means any rule, or a base chain whose policy is not accept,
//! in nftables (which also holds iptables-nft's tables) and in legacy
//! iptables / ip6tables. Empty tables are not rules (listing legacy
//! tables can create them), and crust's own anti-spoofing table is not.
//! A legacy table that cannot be read (no `iptables-legacy-save` on the
//! node) counts as rules: unknown is not empty.

use std::collections::BTreeMap;
use std::fmt;

use crate::forward::FORWARD_TABLE;
use crate::guard::GUARD_TABLE;
use crate::nft;
use crate::{NetError, NetNs};

/// One chain with rules, or with a policy that is not accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleFinding {
    /// `nftables`, `iptables-legacy` or `ip6tables-legacy`.
    pub backend: &'static str,
    /// nftables: `<family> <table>`; legacy: the table.
    pub table: String,
    pub chain: String,
    pub rules: usize,
    /// The policy when it is not accept.
    pub policy: Option<String>,
}

impl fmt::Display for RuleFinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}:", self.backend, self.table, self.chain)?;
        if let Some(p) = &self.policy {
            write!(f, " policy {p}")?;
        }
        if self.rules > 0 {
            write!(
                f,
                " {} rule{}",
                self.rules,
                if self.rules == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// Every chain of `ns` that holds rules or a non-accept policy, in a
/// stable order. `nft` is needed when nftables has any table there.
pub fn inspect(ns: &NetNs) -> Result<Vec<RuleFinding>, NetError> {
    let nft = nft::nft("reading the netfilter rules of the pod's namespace")?;
    let json = nft::run_in(ns, &nft, &["-j", "list", "ruleset"], None)?;
    let mut found = from_nft_json(&json)?;
    for (backend, names, save) in [
        ("iptables-legacy", "ip_tables_names", "iptables-legacy-save"),
        (
            "ip6tables-legacy",
            "ip6_tables_names",
            "ip6tables-legacy-save",
        ),
    ] {
        let tables = legacy_tables(ns, names)?;
        if tables.is_empty() {
            continue;
        }
        match nft::locate(save) {
            Some(tool) => {
                let text = nft::run_in(ns, &tool, &[], None)?;
                found.extend(from_save(backend, &text));
            }
            None => found.extend(tables.into_iter().map(|t| RuleFinding {
                backend,
                table: t,
                chain: "*".into(),
                rules: 0,
                policy: Some(format!("unknown ({save} not on the node)")),
            })),
        }
    }
    Ok(found)
}

/// The tables iptables-nft makes (in families `ip` and `ip6`): their
/// rules are carried in `iptables-save` form, which keeps xtables matches
/// (`-m owner`) that nft's own listing cannot restore.
const IPTABLES_TABLES: [&str; 5] = ["filter", "nat", "mangle", "raw", "security"];

/// The rules of `ns` in the form the guest restores them
/// (`iptables-restore`, per family): what `CRUST_SHIM_NETNS_RULES=guest`
/// carries. iptables rules only, from one backend per family; anything
/// else with rules (a native nftables table, iptables in both backends)
/// is refused by name rather than half carried.
pub fn carry(ns: &NetNs, found: &[RuleFinding]) -> Result<crust_agent_proto::GuestRules, NetError> {
    let refuse = |what: String| {
        NetError::Rules {
            path: ns.path().to_string(),
            found: found.to_vec(),
        }
        .carry_refused(what)
    };
    let mut rules = crust_agent_proto::GuestRules::default();
    for (family, nft_family, legacy, save_nft, save_legacy) in [
        (
            "ipv4",
            "ip",
            "iptables-legacy",
            "iptables-nft-save",
            "iptables-legacy-save",
        ),
        (
            "ipv6",
            "ip6",
            "ip6tables-legacy",
            "ip6tables-nft-save",
            "ip6tables-legacy-save",
        ),
    ] {
        let nft_rules = found.iter().any(|f| {
            f.backend == "nftables"
                && IPTABLES_TABLES
                    .iter()
                    .any(|t| f.table == format!("{nft_family} {t}"))
        });
        let legacy_rules = found.iter().any(|f| f.backend == legacy);
        let tool = match (nft_rules, legacy_rules) {
            (false, false) => continue,
            (true, true) => {
                return Err(refuse(format!(
                    "{family} rules are in both iptables backends (nft and legacy)"
                )));
            }
            (true, false) => save_nft,
            (false, true) => save_legacy,
        };
        let path = nft::locate(tool)
            .ok_or_else(|| refuse(format!("{tool} is not on the node (package iptables)")))?;
        let text = nft::run_in(ns, &path, &[], None)?;
        if text.len() > crust_agent_proto::network::MAX_RULES_BYTES {
            return Err(refuse(format!(
                "{tool}: more than {} bytes",
                crust_agent_proto::network::MAX_RULES_BYTES
            )));
        }
        match family {
            "ipv4" => rules.ipv4 = text,
            _ => rules.ipv6 = text,
        }
    }
    if let Some(other) = found.iter().find(|f| {
        f.backend == "nftables"
            && !["ip", "ip6"].iter().any(|fam| {
                IPTABLES_TABLES
                    .iter()
                    .any(|t| f.table == format!("{fam} {t}"))
            })
    }) {
        return Err(refuse(format!(
            "{other} is a native nftables table; only iptables rules can be carried"
        )));
    }
    Ok(rules)
}

/// The legacy tables the kernel made in `ns` (`/proc/thread-self/net`:
/// the reading thread's namespace, not the process's).
fn legacy_tables(ns: &NetNs, file: &str) -> Result<Vec<String>, NetError> {
    let path = format!("/proc/thread-self/net/{file}");
    ns.run(move || {
        Ok(std::fs::read_to_string(&path)
            .map(|s| s.lines().map(str::to_string).collect())
            .unwrap_or_default())
    })
}

/// Findings from `nft -j list ruleset`.
pub fn from_nft_json(json: &str) -> Result<Vec<RuleFinding>, NetError> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| NetError::Tool {
        what: "nft -j list ruleset".into(),
        reason: format!("unreadable output: {e}"),
    })?;
    let mut chains: BTreeMap<(String, String), RuleFinding> = BTreeMap::new();
    let ours = |o: &serde_json::Value| {
        (o["family"] == "netdev" && o["table"] == GUARD_TABLE)
            || (o["family"] == "inet" && o["table"] == FORWARD_TABLE)
    };
    let text = |o: &serde_json::Value, k: &str| o[k].as_str().unwrap_or("?").to_string();
    for o in v["nftables"].as_array().into_iter().flatten() {
        let (obj, chain, policy) = if let Some(c) = o.get("chain").filter(|c| !ours(c)) {
            match c["policy"].as_str().filter(|p| *p != "accept") {
                Some(p) => (c, text(c, "name"), Some(p.to_string())),
                None => continue,
            }
        } else if let Some(r) = o.get("rule").filter(|r| !ours(r)) {
            (r, text(r, "chain"), None)
        } else {
            continue;
        };
        let table = format!("{} {}", text(obj, "family"), text(obj, "table"));
        let f = chains
            .entry((table.clone(), chain.clone()))
            .or_insert_with(|| RuleFinding {
                backend: "nftables",
                table,
                chain,
                rules: 0,
                policy: None,
            });
        match policy {
            Some(p) => f.policy = Some(p),
            None => f.rules += 1,
        }
    }
    Ok(chains.into_values().collect())
}

/// Findings from `iptables-legacy-save` / `ip6tables-legacy-save`.
pub fn from_save(backend: &'static str, text: &str) -> Vec<RuleFinding> {
    let mut out: BTreeMap<(String, String), RuleFinding> = BTreeMap::new();
    let mut table = String::new();
    for line in text.lines() {
        let mut f = RuleFinding {
            backend,
            table: table.clone(),
            chain: String::new(),
            rules: 0,
            policy: None,
        };
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim().to_string();
            continue;
        } else if let Some(c) = line.strip_prefix(':') {
            let mut w = c.split_whitespace();
            let (Some(chain), Some(policy)) = (w.next(), w.next()) else {
                continue;
            };
            if policy == "ACCEPT" || policy == "-" {
                continue;
            }
            f.chain = chain.to_string();
            f.policy = Some(policy.to_string());
        } else if let Some(rule) = line.strip_prefix("-A ") {
            f.chain = rule.split_whitespace().next().unwrap_or("?").to_string();
            f.rules = 1;
        } else {
            continue;
        }
        let e = out
            .entry((f.table.clone(), f.chain.clone()))
            .or_insert_with(|| RuleFinding {
                rules: 0,
                policy: None,
                ..f.clone()
            });
        e.rules += f.rules;
        if f.policy.is_some() {
            e.policy = f.policy;
        }
    }
    out.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_tables_and_crusts_own_are_not_rules() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
          {"table": {"family": "ip", "name": "filter", "handle": 1}},
          {"chain": {"family": "ip", "table": "filter", "name": "INPUT", "handle": 1, "type": "filter", "hook": "input", "prio": 0, "policy": "accept"}},
          {"table": {"family": "netdev", "name": "crust_guard", "handle": 2}},
          {"chain": {"family": "netdev", "table": "crust_guard", "name": "l0", "handle": 1, "type": "filter", "hook": "ingress", "prio": 0, "policy": "drop"}},
          {"rule": {"family": "netdev", "table": "crust_guard", "chain": "l0", "handle": 3, "expr": []}},
          {"table": {"family": "inet", "name": "crust_forward", "handle": 4}},
          {"chain": {"family": "inet", "table": "crust_forward", "name": "output", "handle": 1, "type": "nat", "hook": "output", "prio": -100, "policy": "accept"}},
          {"rule": {"family": "inet", "table": "crust_forward", "chain": "output", "handle": 2, "expr": []}}]}"#;
        assert_eq!(from_nft_json(json).unwrap(), vec![]);
        // The same table in another family is not ours.
        let theirs = json.replace("\"inet\"", "\"ip\"");
        assert_eq!(from_nft_json(&theirs).unwrap().len(), 1);
    }

    #[test]
    fn rules_and_drop_policies_are_found_by_chain() {
        let json = r#"{"nftables": [
          {"chain": {"family": "ip", "table": "filter", "name": "OUTPUT", "handle": 1, "type": "filter", "hook": "output", "prio": 0, "policy": "drop"}},
          {"chain": {"family": "ip", "table": "nat", "name": "ISTIO_REDIRECT", "handle": 2}},
          {"rule": {"family": "ip", "table": "nat", "chain": "ISTIO_REDIRECT", "handle": 3, "expr": []}},
          {"rule": {"family": "ip", "table": "nat", "chain": "ISTIO_REDIRECT", "handle": 4, "expr": []}}]}"#;
        let f = from_nft_json(json).unwrap();
        let text: Vec<String> = f.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "nftables ip filter OUTPUT: policy drop",
                "nftables ip nat ISTIO_REDIRECT: 2 rules"
            ]
        );
    }

    #[test]
    fn legacy_save_output_counts_rules_and_policies() {
        let text = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n\
                    :ISTIO_INBOUND - [0:0]\n-A PREROUTING -p tcp -j ISTIO_INBOUND\n\
                    -A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN\nCOMMIT\n\
                    *filter\n:INPUT DROP [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        let text: Vec<String> = from_save("iptables-legacy", text)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            text,
            [
                "iptables-legacy filter INPUT: policy DROP",
                "iptables-legacy nat ISTIO_INBOUND: 1 rule",
                "iptables-legacy nat PREROUTING: 1 rule"
            ]
        );
        // Tables with only their built-in chains, all ACCEPT: nothing.
        let empty = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\nCOMMIT\n";
        assert!(from_save("iptables-legacy", empty).is_empty());
    }
}
