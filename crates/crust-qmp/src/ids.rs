//! The ids, node names and serials QEMU takes: checked before a command
//! is sent, so a bad name fails with a clear error.

use crate::QmpError;

/// Longest device id accepted (QEMU itself has no hard limit; we keep ids sane).
pub const MAX_ID_LEN: usize = 127;
/// Longest block node name QEMU accepts (`char node_name[32]` inside QEMU).
pub const MAX_NODE_NAME_LEN: usize = 31;
/// Longest virtio-blk serial the guest sees (`VIRTIO_BLK_ID_BYTES`); QEMU
/// would silently truncate a longer one.
pub const MAX_SERIAL_LEN: usize = 20;

pub(crate) fn check_qemu_id(kind: &str, id: &str, max: usize) -> Result<(), QmpError> {
    let bad = |why: &str| Err(QmpError::InvalidArgument(format!("{kind} {id:?} {why}")));
    if !id.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return bad("must start with a letter");
    }
    if id.len() > max {
        return bad(&format!("is longer than {max} bytes"));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    {
        return bad("may contain only letters, digits, '-', '.' and '_'");
    }
    Ok(())
}

/// Checks a device id against QEMU's rules: a letter, then letters, digits,
/// `-`, `.` or `_`; at most [`MAX_ID_LEN`] bytes.
pub fn validate_id(id: &str) -> Result<(), QmpError> {
    check_qemu_id("device id", id, MAX_ID_LEN)
}

/// Checks a block node name: the id rules, at most [`MAX_NODE_NAME_LEN`]
/// bytes (QEMU rejects longer node names).
pub fn validate_node_name(name: &str) -> Result<(), QmpError> {
    check_qemu_id("node name", name, MAX_NODE_NAME_LEN)
}

/// Checks a virtio-blk serial: 1 to [`MAX_SERIAL_LEN`] printable ASCII
/// characters without spaces.
pub fn validate_serial(serial: &str) -> Result<(), QmpError> {
    if serial.is_empty()
        || serial.len() > MAX_SERIAL_LEN
        || !serial.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(QmpError::InvalidArgument(format!(
            "serial {serial:?} must be 1..={MAX_SERIAL_LEN} printable ASCII characters"
        )));
    }
    Ok(())
}
