//! Paging tokens of the list RPCs (ListVolumes, ListSnapshots,
//! ControllerListVolumeHealth).
//!
//! A token is the URL-safe base64 (no padding) of the last id of the
//! previous page; the next page continues after that id, so pages stay
//! consistent while entries come and go. Tokens are wire format: a CO may
//! hold one across a plugin upgrade, so the encoding must not change.
//! Imports no service: every list RPC takes its tokens from here.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::error::ControllerError;
use crate::records::is_valid_volume_id;

/// The token that continues after `id`.
pub(crate) fn encode_token(id: &str) -> String {
    URL_SAFE_NO_PAD.encode(id.as_bytes())
}

/// A paging token carrying a volume id, or ABORTED.
pub(crate) fn decode_token(token: &str) -> Result<String, ControllerError> {
    decode_token_of(token, is_valid_volume_id)
}

/// A paging token carrying an id `valid` accepts, or ABORTED (the spec's
/// code for a token the plugin did not issue).
pub(crate) fn decode_token_of(
    token: &str,
    valid: fn(&str) -> bool,
) -> Result<String, ControllerError> {
    let bad = || ControllerError::BadToken(token.to_string());
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
    let id = String::from_utf8(bytes).map_err(|_| bad())?;
    if !valid(&id) {
        return Err(bad());
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::volume_id_for;

    #[test]
    fn tokens_round_trip_and_refuse_what_was_not_issued() {
        let id = volume_id_for("x");
        assert_eq!(decode_token(&encode_token(&id)).unwrap(), id);
        assert!(matches!(
            decode_token("!!!"),
            Err(ControllerError::BadToken(_))
        ));
        assert!(matches!(
            decode_token(&encode_token("vol-nothex")),
            Err(ControllerError::BadToken(_))
        ));
    }

    #[test]
    fn the_encoding_is_pinned() {
        // Wire format: URL-safe alphabet, no padding.
        assert_eq!(encode_token("vol-?>"), "dm9sLT8-");
        assert_eq!(encode_token("a"), "YQ");
        assert_eq!(
            decode_token_of("dm9sLT8-", |_| true).unwrap(),
            "vol-?>".to_string()
        );
        assert!(decode_token_of("YQ==", |_| true).is_err());
    }
}
