//! The kernel's mount table format (`/proc/<pid>/mountinfo`, `proc(5)`):
//! one home for its octal escapes and its fields. No I/O: the host reads
//! the table through `crust-blockdev` (cached per mount namespace), the
//! guest agent and the test kit read it themselves and parse it here.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// A line the kernel would not write (1-based line number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed mountinfo line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for ParseError {}

/// A path field, unescaped, as the bytes the kernel holds.
pub fn unescape_path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

/// One line of `/proc/self/mountinfo`, with octal escapes (`\040` etc.)
/// decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    /// Device numbers of the mounted filesystem (for a block device
    /// filesystem, the device's numbers).
    pub major: u32,
    pub minor: u32,
    /// Directory of the filesystem that is mounted here ("/" unless this
    /// is a bind mount of a subdirectory or a file).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options ("rw", "nosuid", "relatime", ...).
    pub mount_options: Vec<String>,
    /// Propagation fields ("shared:1", "master:2", ...).
    pub optional_fields: Vec<String>,
    pub fs_type: String,
    /// Mount source ("/dev/loop3", "tmpfs", ...).
    pub source: String,
    /// Superblock options ("rw", "errors=remount-ro", ...). "ro" here and
    /// "rw" wanted means the filesystem itself went read-only.
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// This mount is read-only (per-mount flag).
    pub fn is_read_only(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro")
    }

    /// The filesystem (superblock) is read-only, e.g. after the kernel
    /// remounted it because of errors.
    pub fn super_read_only(&self) -> bool {
        self.super_options.iter().any(|o| o == "ro")
    }

    /// Value of a superblock option such as `errors`.
    pub fn super_option(&self, key: &str) -> Option<&str> {
        self.super_options
            .iter()
            .find_map(|o| o.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
    }
}

/// Undoes the octal escapes (`\040` space, `\011` tab, `\012` newline,
/// `\134` backslash) the kernel writes in path and option fields.
pub fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        // One byte per escape: `\400` and above are literal text, not a
        // byte silently truncated (the agent's parser reads them so too).
        if field[i] == b'\\'
            && i + 3 < field.len()
            && (b'0'..=b'3').contains(&field[i + 1])
            && field[i + 2..i + 4]
                .iter()
                .all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (field[i + 1] - b'0') as u32 * 64
                + (field[i + 2] - b'0') as u32 * 8
                + (field[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(field[i]);
            i += 1;
        }
    }
    out
}

fn split_opts(field: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(&unescape(field))
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Parses the contents of a mountinfo file (see `proc(5)`): every line,
/// or the first one the kernel would not write.
pub fn parse(text: &[u8]) -> Result<Vec<MountEntry>, ParseError> {
    entries(text).collect()
}

/// Each non-empty line of a mountinfo file, parsed on its own: for a
/// reader that skips a line it cannot read instead of failing the table
/// (the guest agent).
pub fn entries(text: &[u8]) -> impl Iterator<Item = Result<MountEntry, ParseError>> + '_ {
    text.split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .map(|(idx, line)| {
            parse_line(line).map_err(|reason| ParseError {
                line: idx + 1,
                reason: reason.to_owned(),
            })
        })
}

/// One line (without its newline), or why the kernel would not write it.
fn parse_line(line: &[u8]) -> Result<MountEntry, &'static str> {
    let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    let sep = fields
        .iter()
        .position(|f| *f == b"-")
        .ok_or("no \" - \" separator")?;
    if sep < 6 || fields.len() < sep + 4 {
        return Err("too few fields");
    }
    let num = |f: &[u8], what: &'static str| -> Result<u32, &'static str> {
        std::str::from_utf8(f)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(what)
    };
    let (maj, min) = {
        let mm = fields[2];
        let colon = mm
            .iter()
            .position(|&b| b == b':')
            .ok_or("bad major:minor")?;
        (
            num(&mm[..colon], "bad major")?,
            num(&mm[colon + 1..], "bad minor")?,
        )
    };
    let path = unescape_path;
    Ok(MountEntry {
        mount_id: num(fields[0], "bad mount id")?,
        parent_id: num(fields[1], "bad parent id")?,
        major: maj,
        minor: min,
        root: path(fields[3]),
        mount_point: path(fields[4]),
        mount_options: split_opts(fields[5]),
        optional_fields: fields[6..sep]
            .iter()
            .map(|f| String::from_utf8_lossy(f).into_owned())
            .collect(),
        fs_type: String::from_utf8_lossy(&unescape(fields[sep + 1])).into_owned(),
        source: String::from_utf8_lossy(&unescape(fields[sep + 2])).into_owned(),
        super_options: split_opts(fields[sep + 3]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_are_one_byte_each() {
        assert_eq!(unescape(b"/a\\040b\\011c\\012d\\134e"), b"/a b\tc\nd\\e");
        // Not an escape the kernel writes: kept as text, never truncated.
        assert_eq!(unescape(b"/x\\400\\777"), b"/x\\400\\777");
        // Too short at the end, or not octal: literal.
        assert_eq!(unescape(b"/end\\04"), b"/end\\04");
        assert_eq!(unescape(b"/n\\08x"), b"/n\\08x");
        assert_eq!(
            unescape_path(b"/p\\377"),
            PathBuf::from(OsString::from_vec(b"/p\xff".to_vec()))
        );
        // The cases crust-runtime's copy pinned.
        assert_eq!(unescape_path(b"/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape_path(b"/a\\134b"), PathBuf::from("/a\\b"));
        assert_eq!(unescape_path(b"/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape_path(b"/end\\04"), PathBuf::from("/end\\04"));
        assert_eq!(unescape_path(b"/a\\400b"), PathBuf::from("/a\\400b"));
        assert_eq!(unescape_path(b"/a\\777"), PathBuf::from("/a\\777"));
    }

    #[test]
    fn fields_and_refusals() {
        let t =
            b"36 22 7:3 / /mnt/a\\040b rw,nosuid shared:5 - ext4 /dev/loop3 rw,errors=remount-ro\n";
        let e = &parse(t).unwrap()[0];
        assert_eq!((e.mount_id, e.parent_id, e.major, e.minor), (36, 22, 7, 3));
        assert_eq!(e.mount_point, PathBuf::from("/mnt/a b"));
        assert_eq!(e.optional_fields, ["shared:5"]);
        assert_eq!(e.super_option("errors"), Some("remount-ro"));
        let bad = parse(b"1 2 3:4 / /a rw ext4 /dev/x rw\n").unwrap_err();
        assert_eq!(bad.line, 1);
        assert!(parse(b"x 2 3:4 / /a rw - ext4 /dev/x rw\n").is_err());
    }

    #[test]
    fn entries_are_read_line_by_line() {
        let t = b"1 0 0:1 / / rw - rootfs rootfs rw\n\
                  \n\
                  x 1 0:2 / /bad rw - ext4 /dev/x rw\n\
                  3 1 0:3 / /next\\040one ro - xfs /dev/y ro\n";
        let lines: Vec<_> = entries(t).collect();
        assert_eq!(lines.len(), 3, "the empty line is no entry");
        assert_eq!(lines[0].as_ref().unwrap().mount_point, PathBuf::from("/"));
        let bad = lines[1].as_ref().unwrap_err();
        assert_eq!((bad.line, bad.reason.as_str()), (3, "bad mount id"));
        assert_eq!(
            lines[2].as_ref().unwrap().mount_point,
            PathBuf::from("/next one")
        );
        // `parse` refuses the table at its first bad line.
        assert_eq!(parse(t).unwrap_err(), *bad);
        assert_eq!(parse(b"").unwrap(), []);
    }
}
