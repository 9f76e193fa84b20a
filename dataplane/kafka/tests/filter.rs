//! Record filtering against an independent implementation of the same bytes: batches are
//! written by the `kafka-protocol` crate's encoder and what the filter writes is read back by
//! its decoder (CRC-32C checked), with its own gzip and snappy codecs; lz4 and zstd, which that
//! crate only has through C libraries, go through ours on both sides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::{BufMut, Bytes, BytesMut};
use indexmap::IndexMap;
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{
    Compression, Record as KRecord, RecordBatchDecoder, RecordBatchEncoder, RecordEncodeOptions,
    TimestampType,
};
use proptest::prelude::*;
use spur_kafka::{BatchHeader, Codec, Error, Limits, batch, filter};

/// A record with an id in its value and, when `key` is set, a `baggage` header naming it.
fn record(offset: i64, key: Option<&str>) -> KRecord {
    let mut headers = IndexMap::new();
    headers.insert(
        StrBytes::from_static_str("traceparent"),
        Some(Bytes::from_static(
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )),
    );
    if let Some(k) = key {
        headers.insert(
            StrBytes::from_static_str("baggage"),
            Some(Bytes::from(format!("userId=alice,sd-routing-key={k}"))),
        );
    }
    KRecord {
        transactional: false,
        control: false,
        delete_horizon: false,
        partition_leader_epoch: 7,
        producer_id: 4242,
        producer_epoch: 3,
        timestamp_type: TimestampType::Creation,
        offset,
        sequence: offset as i32,
        timestamp: 1_700_000_000_000 + offset * 10,
        key: Some(Bytes::from(format!("k{offset}"))),
        value: Some(Bytes::from(format!("record {offset} {}", "x".repeat(40)))),
        headers,
    }
}

/// One batch of `records` in `codec`, written by kafka-protocol.
fn encode(records: &[KRecord], codec: Codec) -> BytesMut {
    let mut buf = BytesMut::new();
    let options = RecordEncodeOptions {
        version: 2,
        compression: codec.into(),
    };
    match codec {
        Codec::None | Codec::Gzip | Codec::Snappy => {
            RecordBatchEncoder::encode(&mut buf, records, &options).unwrap()
        }
        Codec::Lz4 | Codec::Zstd => RecordBatchEncoder::encode_with_custom_compression(
            &mut buf,
            records,
            &options,
            Some(|raw: &mut BytesMut, out: &mut BytesMut, c: Compression| {
                let packed =
                    spur_kafka::codec::compress(Codec::from(c), raw).map_err(anyhow::Error::msg)?;
                out.put_slice(&packed);
                Ok(())
            }),
        )
        .unwrap(),
    }
    buf
}

/// Every record of `blob`, read by kafka-protocol (gzip and snappy with its own codecs).
fn decode(blob: &Bytes) -> Vec<KRecord> {
    let mut buf = blob.clone();
    let mut out = Vec::new();
    while !buf.is_empty() {
        let set = RecordBatchDecoder::decode_with_custom_compression(
            &mut buf,
            Some(
                |packed: &mut Bytes, c: Compression| -> anyhow::Result<Bytes> {
                    match c {
                        Compression::Lz4 | Compression::Zstd => Ok(Bytes::from(
                            spur_kafka::codec::decompress(Codec::from(c), packed, 1 << 26)
                                .map_err(anyhow::Error::msg)?,
                        )),
                        Compression::None => Ok(packed.clone()),
                        Compression::Gzip => {
                            use kafka_protocol::compression::{Decompressor, Gzip};
                            Gzip::decompress(packed, |b| Ok(b.clone()))
                        }
                        Compression::Snappy => {
                            use kafka_protocol::compression::{Decompressor, Snappy};
                            Snappy::decompress(packed, |b| Ok(b.clone()))
                        }
                    }
                },
            ),
        )
        .unwrap();
        out.extend(set.records);
    }
    out
}

/// Every batch header of `blob`, read by our reader.
fn headers(blob: &[u8]) -> Vec<BatchHeader> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < blob.len() {
        let h = BatchHeader::read(&blob[pos..]).unwrap();
        pos += batch::LOG_OVERHEAD + h.batch_length as usize;
        out.push(h);
    }
    out
}

fn keyed(extractor: &spur_routing::KeyExtractor, r: &spur_kafka::Record<'_>) -> Option<String> {
    spur_kafka::key::with_candidates(extractor, r, |c| c.first().map(str::to_string))
}

/// Three batches of 10 records, every third keyed `sbx1`, in `codec`.
fn three_batches(codec: Codec) -> (Bytes, Vec<KRecord>) {
    let mut blob = BytesMut::new();
    let mut all = Vec::new();
    for b in 0..3 {
        let recs: Vec<KRecord> = (0..10)
            .map(|i| {
                let off = b * 10 + i;
                record(off, (off % 3 == 0).then_some("sbx1"))
            })
            .collect();
        blob.extend_from_slice(&encode(&recs, codec));
        all.extend(recs);
    }
    (blob.freeze(), all)
}

#[test]
fn the_baseline_and_the_fork_see_complementary_records_in_every_codec() {
    let extractor = spur_routing::KeyExtractor::new(&Default::default()).unwrap();
    for codec in Codec::ALL {
        let (blob, all) = three_batches(codec);
        let baseline = filter(&blob, &Limits::default(), |_, r| {
            keyed(&extractor, r).is_none()
        })
        .unwrap();
        let fork = filter(&blob, &Limits::default(), |_, r| {
            keyed(&extractor, r).as_deref() == Some("sbx1")
        })
        .unwrap();
        let b = decode(&baseline.records);
        let f = decode(&fork.records);
        let want_b: Vec<&KRecord> = all.iter().filter(|r| r.offset % 3 != 0).collect();
        let want_f: Vec<&KRecord> = all.iter().filter(|r| r.offset % 3 == 0).collect();
        assert_eq!(b.iter().collect::<Vec<_>>(), want_b, "{codec}");
        assert_eq!(f.iter().collect::<Vec<_>>(), want_f, "{codec}");
        assert_eq!(
            (baseline.stats.records_kept, baseline.stats.records_dropped),
            (20, 10)
        );
        assert_eq!(
            (fork.stats.records_kept, fork.stats.records_dropped),
            (10, 20)
        );
        assert_eq!(baseline.stats.batches_rewritten, 3);

        // Every rewritten batch keeps where consumers resume, its producer fields and codec.
        let before = headers(&blob);
        for out in [&baseline.records, &fork.records] {
            let after = headers(out);
            assert_eq!(after.len(), 3, "{codec}");
            for (a, b) in after.iter().zip(&before) {
                assert_eq!(a.base_offset, b.base_offset);
                assert_eq!(a.last_offset(), b.last_offset());
                assert_eq!(a.base_timestamp, b.base_timestamp);
                assert_eq!(a.max_timestamp, b.max_timestamp);
                assert_eq!(
                    (a.producer_id, a.producer_epoch, a.base_sequence),
                    (b.producer_id, b.producer_epoch, b.base_sequence)
                );
                assert_eq!(a.partition_leader_epoch, b.partition_leader_epoch);
                assert_eq!(a.codec().unwrap(), codec);
            }
        }
    }
}

#[test]
fn a_batch_with_nothing_kept_stays_as_an_empty_uncompressed_control_batch() {
    for codec in Codec::ALL {
        let recs: Vec<KRecord> = (100..105).map(|o| record(o, None)).collect();
        let blob = encode(&recs, codec).freeze();
        let out = filter(&blob, &Limits::default(), |_, _| false).unwrap();
        let h = headers(&out.records);
        assert_eq!(h.len(), 1);
        assert_eq!((h[0].base_offset, h[0].last_offset()), (100, 104));
        assert_eq!(h[0].record_count, 0);
        assert_eq!(h[0].codec().unwrap(), Codec::None);
        // A control batch: clients skip it, and librdkafka does not take a response of only
        // such batches for a record too large to fetch.
        assert!(h[0].is_control(), "{codec}");
        assert_eq!(h[0].crc, batch::checksum(&out.records));
        assert_eq!(out.records.len(), batch::HEADER_LEN);
        assert!(decode(&out.records).is_empty(), "{codec}");
        assert_eq!(out.stats.batches_emptied, 1);
        // The empty batch is itself a valid input: filtering it again changes nothing.
        let again = filter(&out.records, &Limits::default(), |_, _| false).unwrap();
        assert_eq!(again.records, out.records);
    }
}

#[test]
fn dropping_the_last_record_keeps_the_last_offset() {
    let recs: Vec<KRecord> = (0..4).map(|o| record(o, None)).collect();
    let blob = encode(&recs, Codec::None).freeze();
    let out = filter(&blob, &Limits::default(), |_, r| r.offset < 2).unwrap();
    let h = headers(&out.records);
    assert_eq!((h[0].record_count, h[0].last_offset()), (2, 3));
    let got: Vec<i64> = decode(&out.records).iter().map(|r| r.offset).collect();
    assert_eq!(got, [0, 1]);
}

#[test]
fn nothing_dropped_means_the_same_bytes_without_a_copy() {
    let (blob, _) = three_batches(Codec::Gzip);
    let out = filter(&blob, &Limits::default(), |_, _| true).unwrap();
    assert_eq!(out.records.as_ptr(), blob.as_ptr());
    assert_eq!(out.records.len(), blob.len());
    assert_eq!(out.stats.batches_rewritten, 0);
    assert_eq!(out.stats.records_kept, 30);
}

#[test]
fn a_batch_cut_off_at_the_end_is_left_out() {
    let (blob, _) = three_batches(Codec::None);
    let whole = headers(&blob);
    let first_two: usize = whole[..2]
        .iter()
        .map(|h| batch::LOG_OVERHEAD + h.batch_length as usize)
        .sum();
    for cut in [
        first_two + 1,
        first_two + 11,
        first_two + 12,
        blob.len() - 1,
    ] {
        let partial = blob.slice(..cut);
        let out = filter(&partial, &Limits::default(), |_, _| true).unwrap();
        assert_eq!(out.records.len(), first_two, "cut at {cut}");
        assert_eq!(out.stats.partial_tail_bytes as usize, cut - first_two);
        // And when records are dropped from the whole batches before it.
        let out = filter(&partial, &Limits::default(), |_, r| r.offset % 2 == 0).unwrap();
        assert_eq!(decode(&out.records).len(), 10, "cut at {cut}");
    }
}

#[test]
fn control_batches_pass_untouched_and_are_not_offered() {
    let mut commit = record(10, None);
    commit.control = true;
    commit.transactional = true;
    // A commit marker: key = version 0, type 1; value = version 0, coordinator epoch.
    commit.key = Some(Bytes::from_static(&[0, 0, 0, 1]));
    commit.value = Some(Bytes::from_static(&[0, 0, 0, 0, 0, 5]));
    commit.headers.clear();
    let mut data: Vec<KRecord> = (0..10).map(|o| record(o, None)).collect();
    for r in &mut data {
        r.transactional = true;
    }
    let mut blob = encode(&data, Codec::Zstd);
    let marker = encode(std::slice::from_ref(&commit), Codec::None);
    blob.extend_from_slice(&marker);
    let blob = blob.freeze();
    let mut offered = Vec::new();
    let out = filter(&blob, &Limits::default(), |h, r| {
        assert!(h.is_transactional() && !h.is_control());
        offered.push(r.offset);
        r.offset >= 5
    })
    .unwrap();
    assert_eq!(offered, (0..10).collect::<Vec<_>>());
    assert!(out.records.ends_with(&marker));
    assert_eq!(out.stats.control_batches, 1);
    let got = decode(&out.records);
    assert_eq!(got.len(), 6);
    assert!(got[5].control && got[5].transactional);
}

#[test]
fn log_append_time_batches_give_the_broker_timestamp() {
    let recs: Vec<KRecord> = (0..3).map(|o| record(o, None)).collect();
    let mut blob = encode(&recs, Codec::None);
    // The broker sets the bit and max timestamp when it stamps a batch.
    blob[22] |= 0x08;
    blob[35..43].copy_from_slice(&1_800_000_000_000i64.to_be_bytes());
    let crc = batch::checksum(&blob);
    blob[17..21].copy_from_slice(&crc.to_be_bytes());
    let blob = blob.freeze();
    let mut seen = Vec::new();
    filter(&blob, &Limits::default(), |_, r| {
        seen.push(r.timestamp);
        true
    })
    .unwrap();
    assert_eq!(seen, [1_800_000_000_000; 3]);
    let out = filter(&blob, &Limits::default(), |_, r| r.offset == 1).unwrap();
    let h = headers(&out.records);
    assert!(h[0].log_append_time());
}

#[test]
fn corrupt_batches_are_errors_never_passed_on() {
    let (blob, _) = three_batches(Codec::None);
    let keep_all = |_: &BatchHeader, _: &spur_kafka::Record<'_>| true;

    let mut flipped = blob.to_vec();
    flipped[200] ^= 1;
    assert!(matches!(
        filter(&Bytes::from(flipped), &Limits::default(), keep_all),
        Err(Error::Crc { base_offset: 0, .. })
    ));

    let mut magic1 = blob.to_vec();
    magic1[16] = 1;
    assert!(matches!(
        filter(&Bytes::from(magic1), &Limits::default(), keep_all),
        Err(Error::Magic { magic: 1, .. })
    ));

    let mut short = blob.to_vec();
    short[8..12].copy_from_slice(&20i32.to_be_bytes());
    assert!(matches!(
        filter(&Bytes::from(short), &Limits::default(), keep_all),
        Err(Error::Batch { .. })
    ));

    let fix = |mut b: Vec<u8>| {
        let crc = batch::checksum(
            &b[..batch::LOG_OVERHEAD + i32::from_be_bytes(b[8..12].try_into().unwrap()) as usize],
        );
        b[17..21].copy_from_slice(&crc.to_be_bytes());
        Bytes::from(b)
    };
    // A count the records cannot fill, with a valid CRC: refused before any allocation.
    let mut count = blob.to_vec();
    count[57..61].copy_from_slice(&i32::MAX.to_be_bytes());
    let err = filter(&fix(count), &Limits::default(), keep_all).unwrap_err();
    assert!(err.to_string().contains("cannot fit"), "{err}");
    // One record fewer than there are: bytes left after the last.
    let mut fewer = blob.to_vec();
    fewer[57..61].copy_from_slice(&9i32.to_be_bytes());
    let err = filter(&fix(fewer), &Limits::default(), keep_all).unwrap_err();
    assert!(err.to_string().contains("after the last"), "{err}");
    // Codec 5 does not exist.
    let mut codec = blob.to_vec();
    codec[22] |= 0x05;
    assert!(matches!(
        filter(&fix(codec), &Limits::default(), keep_all),
        Err(Error::Codec { codec: 5, .. })
    ));
    // A last offset delta below the records' deltas.
    let mut delta = blob.to_vec();
    delta[23..27].copy_from_slice(&3i32.to_be_bytes());
    let err = filter(&fix(delta), &Limits::default(), keep_all).unwrap_err();
    assert!(err.to_string().contains("offset delta"), "{err}");
}

#[test]
fn a_batch_over_the_limit_is_an_error_in_every_codec() {
    for codec in Codec::ALL {
        let (blob, _) = three_batches(codec);
        let small = Limits {
            max_batch_bytes: 200,
        };
        let err = filter(&blob, &small, |_, _| true).unwrap_err();
        assert!(matches!(err, Error::Decompress { .. }), "{codec}: {err}");
        assert!(err.to_string().contains("limit"), "{codec}: {err}");
    }
}

#[test]
fn keys_come_from_every_carrier_the_http_path_reads() {
    let extractor = spur_routing::KeyExtractor::new(&spur_routing::ExtractConfig {
        custom_headers: vec!["x-tenant-route".into()],
        query_param: None,
    })
    .unwrap();
    let cases: Vec<(Vec<Header<'_>>, Option<&str>)> = vec![
        (vec![("baggage", Some(b"sd-routing-key=a1"))], Some("a1")),
        (vec![("Baggage", Some(b"foo=1,sd-sandbox=a2"))], Some("a2")),
        (vec![("tracestate", Some(b"sd-routing-key=a3"))], Some("a3")),
        (vec![("ot-baggage-sd-routing-key", Some(b"a4"))], Some("a4")),
        (vec![("uberctx-sd-routing-key", Some(b"a5"))], Some("a5")),
        (vec![("x-tenant-route", Some(b"a6"))], Some("a6")),
        // Custom headers come first, as in HTTP.
        (
            vec![
                ("baggage", Some(b"sd-routing-key=b1")),
                ("x-tenant-route", Some(b"a7")),
            ],
            Some("a7"),
        ),
        // Repeated keys are all read (baggage lines join into one list).
        (
            vec![
                ("baggage", Some(b"foo=1")),
                ("baggage", Some(b"sd-routing-key=a8")),
            ],
            Some("a8"),
        ),
        (vec![("baggage", None)], None),
        (vec![("baggage", Some(b"sd-routing-key=bad key"))], None),
        (vec![("baggage", Some(b"sd-routing-key=\x01"))], None),
        (vec![("other", Some(b"sd-routing-key=a9"))], None),
        (vec![], None),
    ];
    for (hdrs, want) in cases {
        let mut headers = IndexMap::new();
        // kafka-protocol's map collapses repeated keys, so repeated ones are written by hand.
        let repeated = hdrs.len() == 2 && hdrs[0].0 == hdrs[1].0;
        for (k, v) in &hdrs {
            headers.insert(
                StrBytes::from_string(k.to_string()),
                v.map(Bytes::copy_from_slice),
            );
        }
        let mut r = record(0, None);
        r.headers = headers;
        let mut blob = encode(std::slice::from_ref(&r), Codec::None);
        if repeated {
            blob = raw_batch_with_headers(&hdrs);
        }
        let mut got = None;
        filter(&blob.freeze(), &Limits::default(), |_, rec| {
            got = keyed(&extractor, rec);
            true
        })
        .unwrap();
        assert_eq!(got.as_deref(), want, "{hdrs:?}");
    }
}

/// A record header as written: key and value (`None` for null).
type Header<'a> = (&'a str, Option<&'a [u8]>);

fn varint(out: &mut Vec<u8>, v: i64) {
    let mut raw = ((v << 1) ^ (v >> 63)) as u64;
    while raw >= 0x80 {
        out.push((raw as u8) | 0x80);
        raw >>= 7;
    }
    out.push(raw as u8);
}

/// A one-record uncompressed batch of the record `body` (attributes to headers).
fn raw_batch_of(body: &[u8]) -> BytesMut {
    let mut rec = Vec::new();
    varint(&mut rec, body.len() as i64);
    rec.extend_from_slice(body);
    let mut header = [0u8; batch::HEADER_LEN];
    header[16] = 2;
    let mut out = Vec::new();
    batch::rewrite(&header, Codec::None, 1, &rec, &mut out).unwrap();
    BytesMut::from(&out[..])
}

/// Lengths below -1 are null, as the Java client reads them (`DefaultRecord.readFrom`), for keys,
/// values and header values: such a record is delivered, not refused (refusing it would close
/// the consumer's connection at that offset for good). A negative header key length is refused,
/// as the Java client refuses it.
#[test]
fn negative_lengths_read_as_the_java_client_reads_them() {
    let body = |header_key_len: i64| {
        let mut b = vec![0u8]; // attributes
        varint(&mut b, 0); // timestamp delta
        varint(&mut b, 0); // offset delta
        varint(&mut b, -2); // key: null
        varint(&mut b, -3); // value: null
        varint(&mut b, 1); // one header
        varint(&mut b, header_key_len);
        if header_key_len > 0 {
            b.extend_from_slice(b"baggage");
        }
        varint(&mut b, -7); // its value: null
        b
    };
    let blob = raw_batch_of(&body(7)).freeze();
    let mut seen = Vec::new();
    let out = filter(&blob, &Limits::default(), |_, r| {
        let headers: Vec<(Vec<u8>, Option<Vec<u8>>)> = r
            .headers()
            .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
            .collect();
        seen.push((r.key.is_none(), r.value.is_none(), headers));
        true
    })
    .unwrap();
    assert_eq!(out.records, blob, "delivered as it came");
    assert_eq!(seen, [(true, true, vec![(b"baggage".to_vec(), None)])]);
    let refused = raw_batch_of(&body(-1)).freeze();
    let e = filter(&refused, &Limits::default(), |_, _| true).unwrap_err();
    assert!(e.to_string().contains("null key"), "{e}");
}

/// A one-record uncompressed batch with exactly these headers, repeats included.
fn raw_batch_with_headers(hdrs: &[Header<'_>]) -> BytesMut {
    let mut body = vec![0u8]; // attributes
    varint(&mut body, 0); // timestamp delta
    varint(&mut body, 0); // offset delta
    varint(&mut body, -1); // null key
    varint(&mut body, 1);
    body.push(b'v');
    varint(&mut body, hdrs.len() as i64);
    for (k, v) in hdrs {
        varint(&mut body, k.len() as i64);
        body.extend_from_slice(k.as_bytes());
        match v {
            Some(v) => {
                varint(&mut body, v.len() as i64);
                body.extend_from_slice(v);
            }
            None => varint(&mut body, -1),
        }
    }
    raw_batch_of(&body)
}

fn arb_codec() -> impl Strategy<Value = Codec> {
    prop::sample::select(Codec::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any split of records into batches, any codecs, any decisions: the output decodes (by the
    /// other implementation) to exactly the kept records, the batches' resume points stay, and
    /// filtering the output again with the same decision changes nothing.
    #[test]
    fn filtering_keeps_exactly_the_chosen_records(
        batches in prop::collection::vec((arb_codec(), 1usize..12, 0i64..3), 1..5),
        seed in any::<u64>(),
    ) {
        let mut blob = BytesMut::new();
        let mut all = Vec::new();
        let mut offset = 0;
        for (codec, n, gap) in batches {
            let recs: Vec<KRecord> = (0..n as i64).map(|i| record(offset + i * (gap + 1), None)).collect();
            offset += n as i64 * (gap + 1) + gap;
            blob.extend_from_slice(&encode(&recs, codec));
            all.extend(recs);
        }
        let blob = blob.freeze();
        let keep = |o: i64| (o as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        let decide = |_: &BatchHeader, r: &spur_kafka::Record<'_>| keep(r.offset) % 3 != 0;
        let out = filter(&blob, &Limits::default(), decide).unwrap();
        let got = decode(&out.records);
        let want: Vec<KRecord> = all.iter().filter(|r| keep(r.offset) % 3 != 0).cloned().collect();
        prop_assert_eq!(got, want);
        let (a, b) = (headers(&out.records), headers(&blob));
        prop_assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            prop_assert_eq!((x.base_offset, x.last_offset()), (y.base_offset, y.last_offset()));
        }
        let again = filter(&out.records, &Limits::default(), decide).unwrap();
        prop_assert_eq!(again.records, out.records);
        prop_assert_eq!(again.stats.batches_rewritten, 0);
    }
}
