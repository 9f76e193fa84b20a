//! Fuzzes the Kafka record filter (`spur_kafka::filter`): a Fetch response's `records` for one
//! partition, as a broker (or a producer through it) could shape them, filtered by a decision
//! taken from the fuzzer's input and by routing key (`spur_kafka::key`).
//!
//! Input: byte 0 holds flags: bit 0 fixes each batch's CRC-32C before filtering (so the fuzzer
//! reaches the record walk and the codecs instead of stopping at the checksum), bit 1 picks a
//! small decompression limit, bits 2-7 seed the keep decision. The rest is the records blob.
//!
//! Checks: no panic; on success the output is whole batches only, each with a valid CRC, the
//! same base offsets and last offsets as the input's whole batches, record counts that add up
//! to what was kept; keeping everything returns the input's whole batches unchanged; filtering
//! the output again with the same decision changes nothing.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use spur_kafka::batch::{self, LOG_OVERHEAD};
use spur_kafka::{BatchHeader, Limits, Record, filter};

/// The batches at the start of `blob` that are whole: (start, length).
fn whole_batches(blob: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(head) = blob.get(pos..pos + LOG_OVERHEAD) {
        let len = i32::from_be_bytes([head[8], head[9], head[10], head[11]]);
        let Ok(len) = usize::try_from(len) else { break };
        let end = pos + LOG_OVERHEAD + len;
        if len < batch::HEADER_LEN - LOG_OVERHEAD || end > blob.len() {
            break;
        }
        out.push((pos, end - pos));
        pos = end;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut blob = rest.to_vec();
    if flags & 1 != 0 {
        for (start, len) in whole_batches(&blob) {
            let crc = batch::checksum(&blob[start..start + len]);
            if len >= batch::HEADER_LEN {
                blob[start + 17..start + 21].copy_from_slice(&crc.to_be_bytes());
            }
        }
    }
    let limits = Limits {
        max_batch_bytes: if flags & 2 != 0 { 4096 } else { 1 << 20 },
    };
    let seed = u64::from(flags >> 2);
    let extractor = spur_routing::KeyExtractor::new(&Default::default()).unwrap();
    let blob = Bytes::from(blob);

    let decide = |_: &BatchHeader, r: &Record<'_>| {
        let keyed = spur_kafka::key::with_candidates(&extractor, r, |c| {
            for k in c.iter() {
                assert!(spur_routing::extract::is_valid_key(k));
            }
            c.first().is_some()
        });
        // Drop keyed records, and some others by the seed.
        !keyed
            && (r.offset as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(seed)
                % 4
                != 0
    };
    let mut offered = 0u64;
    let mut kept = 0u64;
    let Ok(out) = filter(&blob, &limits, |h, r| {
        offered += 1;
        // The record's headers iterate to exactly their count without failing.
        let _ = r.headers().count();
        let k = decide(h, r);
        kept += u64::from(k);
        k
    }) else {
        return;
    };
    assert_eq!(out.stats.records_kept, kept);
    assert_eq!(out.stats.records_kept + out.stats.records_dropped, offered);

    let ins = whole_batches(&blob);
    let outs = whole_batches(&out.records);
    let covered = outs.last().map_or(0, |(s, l)| s + l);
    assert_eq!(covered, out.records.len(), "output is whole batches only");
    assert_eq!(ins.len(), outs.len());
    let mut count = 0u64;
    for (&(si, li), &(so, lo)) in ins.iter().zip(&outs) {
        let a = BatchHeader::read(&blob[si..si + li]).unwrap();
        let b = BatchHeader::read(&out.records[so..so + lo]).unwrap();
        assert_eq!(b.crc, batch::checksum(&out.records[so..so + lo]));
        assert_eq!(
            (a.base_offset, a.last_offset()),
            (b.base_offset, b.last_offset())
        );
        if !b.is_control() {
            count += u64::try_from(b.record_count).unwrap();
        }
    }
    assert_eq!(count, kept);

    let again = filter(&out.records, &limits, decide).expect("the output filters again");
    assert_eq!(again.records, out.records);

    if let Ok(all) = filter(&blob, &limits, |_, _| true) {
        let in_end = ins.last().map_or(0, |(s, l)| s + l);
        assert_eq!(all.records, blob.slice(..in_end));
        if in_end > 0 {
            assert_eq!(all.records.as_ptr(), blob.as_ptr(), "kept whole: no copy");
        }
    }
});
