//! The shim API's routes (crust_shim_api::Call), which the shim server
//! applies to every request on the sandbox socket: crust's endpoints and
//! Kata's `/direct-volume/*`. Input: an HTTP/1.1 request as a client
//! writes it, its head read by httparse and its target by `http::Uri`
//! (what hyper uses in the server). Invariants: no panic; a request that
//! reads as a call is written again by `Call::wire` into a request that
//! reads as the same call; malformed input is INVALID_ARGUMENT or
//! NOT_FOUND, never anything else; an error survives the trip through
//! both of its answer forms (JSON, and Kata's text).
#![no_main]

use crust_shim_api::{ApiError, Call, Code};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(head)) = req.parse(data) else {
        return;
    };
    let (Some(method), Some(target)) = (req.method, req.path) else {
        return;
    };
    let Ok(uri) = target.parse::<http::Uri>() else {
        return;
    };
    let body = &data[head..];
    let got = Call::parse(method, uri.path(), uri.query(), body);
    match got {
        Ok(call) => {
            let w = call.wire();
            let uri: http::Uri = w.path_and_query.parse().expect("wire target is a URI");
            let again = Call::parse(w.method, uri.path(), uri.query(), &w.body.unwrap_or_default());
            assert_eq!(again.as_ref(), Ok(&call));
        }
        Err(e) => {
            assert!(
                matches!(e.code, Code::InvalidArgument | Code::NotFound),
                "{e:?}"
            );
            let json = serde_json::to_vec(&e).expect("serializable");
            assert_eq!(ApiError::from_body(&json).as_ref(), Some(&e));
            let text = ApiError::from_body(e.to_text().as_bytes()).expect("text form reads");
            assert_eq!(text.code, e.code);
            assert_eq!(text.message, e.message.trim_end_matches('\n'));
        }
    }
});
