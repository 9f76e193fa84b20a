//! Fuzzes what a smart test reads from a gRPC server's reflection: the body of one reflection
//! call (length-prefixed messages, each a `ServerReflectionResponse`), through
//! `spur_smarttest::reflect::files_in`, and the files it returns through `descriptor_pool`.
//!
//! Input: the number of questions asked (first byte, 1 to 8), then the answer body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spur_smarttest::reflect::{descriptor_pool, files_in};

fuzz_target!(|data: &[u8]| {
    let Some((&asked, body)) = data.split_first() else {
        return;
    };
    let asked = usize::from(asked % 8) + 1;
    match files_in(body, asked) {
        Ok(files) => {
            // Every file came from the body: it cannot hold more bytes than that.
            let total: usize = files.iter().map(|f| f.bytes.len()).sum();
            assert!(total <= body.len(), "{total} > {}", body.len());
            let _ = descriptor_pool(files.into_iter().map(|f| f.bytes));
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
