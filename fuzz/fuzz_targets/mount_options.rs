//! THE mount-option allow-list (crust_fs::options::parse), which every
//! front door and the guest agent apply. Input: one header byte (bit 0:
//! xfs, bit 1: the readonly request), then the option list, one element
//! per line (an element may hold several comma-separated options).
//! Invariants: no panic; what it accepts is idempotent (its words parse
//! to the same result), never holds an empty, spaced or comma word, and
//! the agent's mapping agrees with it.
#![no_main]

use arbitrary::Unstructured;
use crust_fs::FsType;
use crust_fs::options::parse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let head = u.arbitrary::<u8>().unwrap_or(0);
    let fstype = if head & 1 == 0 {
        FsType::Ext4
    } else {
        FsType::Xfs
    };
    let readonly = head & 2 != 0;
    let Ok(text) = std::str::from_utf8(u.take_rest()) else {
        return;
    };
    let options: Vec<String> = text.split('\n').map(str::to_string).collect();
    let got = parse(fstype, &options, readonly);
    let agent = crust_agent::options::parse(fstype, &options, readonly);
    assert_eq!(got.is_ok(), agent.is_ok());
    let Ok(p) = got else { return };
    for w in &p.words {
        assert!(!w.is_empty() && !w.contains([',', ' ']), "{w:?}");
    }
    assert_eq!(parse(fstype, &p.words, readonly).as_ref(), Ok(&p));
    // One element holding every word is the same list.
    assert_eq!(
        parse(fstype, &[p.words.join(",")], readonly).as_ref(),
        Ok(&p)
    );
});
