// The Java Kafka client (kafka-clients 3.9.2, unchanged) as a test tool: creates topics,
// produces numbered records and consumes them, printing what it did one record per line.
//
//   java -cp 'lib/*:classes' Probe create   BOOTSTRAP TOPIC PARTITIONS
//   java -cp 'lib/*:classes' Probe produce  BOOTSTRAP TOPIC CODEC PREFIX COUNT KEY [TXN_ID]
//       COUNT records with values PREFIX-0 .. PREFIX-(COUNT-1) compressed with CODEC; each
//       carries the header `baggage: sd-routing-key=KEY` unless KEY is "-" (KEY/N: only every
//       N-th record, the others none); in one committed transaction when TXN_ID is given.
//       Prints "produced COUNT".
//   java -cp 'lib/*:classes' Probe stream   BOOTSTRAP TOPIC PREFIX COUNT KEY/N PAUSE_MS
//       COUNT records as `produce` (no compression), one at a time, PAUSE_MS apart, each acked
//       before the next; prints "sent VALUE TIMESTAMP" per record (the CreateTime it carries).
//   java -cp 'lib/*:classes' Probe consume  BOOTSTRAP TOPIC GROUP COUNT TIMEOUT_MS [IDLE_MS [sync]]
//       Reads (group GROUP, from the earliest offset, read_committed) until COUNT records came,
//       TIMEOUT_MS passed, or (with IDLE_MS > 0) IDLE_MS passed without a record after the first;
//       prints "record PARTITION OFFSET VALUE" per record. With `sync`, commits each poll's
//       records before printing them (retrying while the coordinator is away), so a record is
//       printed at most once even across rebalances and broker restarts. Exit 0 either way: the
//       test compares what was read.
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;
import java.util.HashMap;
import java.util.Map;

import org.apache.kafka.clients.consumer.CommitFailedException;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.RebalanceInProgressException;
import org.apache.kafka.common.errors.RetriableException;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

public class Probe {
    public static void main(String[] args) throws Exception {
        switch (args[0]) {
            case "create" -> create(args[1], args[2], Integer.parseInt(args[3]));
            case "produce" -> produce(args[1], args[2], args[3], args[4], Integer.parseInt(args[5]),
                    args[6], args.length > 7 ? args[7] : null);
            case "stream" -> stream(args[1], args[2], args[3], Integer.parseInt(args[4]), args[5],
                    Long.parseLong(args[6]));
            case "consume" -> consume(args[1], args[2], args[3], Integer.parseInt(args[4]),
                    Long.parseLong(args[5]), args.length > 6 ? Long.parseLong(args[6]) : 0,
                    args.length > 7 && args[7].equals("sync"));
            default -> throw new IllegalArgumentException("unknown command " + args[0]);
        }
    }

    static void create(String bootstrap, String topic, int partitions) throws Exception {
        Properties p = new Properties();
        p.put("bootstrap.servers", bootstrap);
        try (Admin admin = Admin.create(p)) {
            admin.createTopics(List.of(new NewTopic(topic, partitions, (short) 1))).all().get();
        }
        System.out.println("created " + topic);
    }

    static void produce(String bootstrap, String topic, String codec, String prefix, int count,
            String key, String txn) throws Exception {
        Properties p = new Properties();
        p.put("bootstrap.servers", bootstrap);
        p.put("compression.type", codec);
        p.put("linger.ms", "20");
        p.put("key.serializer", StringSerializer.class.getName());
        p.put("value.serializer", StringSerializer.class.getName());
        if (txn != null) {
            p.put("transactional.id", txn);
        }
        int every = 1;
        if (key.contains("/")) {
            every = Integer.parseInt(key.substring(key.indexOf('/') + 1));
            key = key.substring(0, key.indexOf('/'));
        }
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
            if (txn != null) {
                producer.initTransactions();
                producer.beginTransaction();
            }
            for (int i = 0; i < count; i++) {
                ProducerRecord<String, String> r = new ProducerRecord<>(topic, prefix + "-" + i, prefix + "-" + i);
                if (!key.equals("-") && i % every == 0) {
                    r.headers().add("baggage", ("sd-routing-key=" + key).getBytes(StandardCharsets.UTF_8));
                }
                producer.send(r);
            }
            if (txn != null) {
                producer.commitTransaction();
            }
            producer.flush();
        }
        System.out.println("produced " + count);
    }

    static void stream(String bootstrap, String topic, String prefix, int count, String key,
            long pauseMs) throws Exception {
        Properties p = new Properties();
        p.put("bootstrap.servers", bootstrap);
        p.put("key.serializer", StringSerializer.class.getName());
        p.put("value.serializer", StringSerializer.class.getName());
        int every = Integer.parseInt(key.substring(key.indexOf('/') + 1));
        key = key.substring(0, key.indexOf('/'));
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
            for (int i = 0; i < count; i++) {
                String value = prefix + "-" + i;
                ProducerRecord<String, String> r = new ProducerRecord<>(topic, value, value);
                if (i % every == 0) {
                    r.headers().add("baggage", ("sd-routing-key=" + key).getBytes(StandardCharsets.UTF_8));
                }
                long ts = producer.send(r).get().timestamp();
                System.out.println("sent " + value + " " + ts);
                System.out.flush();
                Thread.sleep(pauseMs);
            }
        }
    }

    static void consume(String bootstrap, String topic, String group, int count, long timeoutMs,
            long idleMs, boolean sync) {
        Properties p = new Properties();
        p.put("bootstrap.servers", bootstrap);
        p.put("group.id", group);
        p.put("auto.offset.reset", "earliest");
        p.put("isolation.level", "read_committed");
        p.put("key.deserializer", StringDeserializer.class.getName());
        p.put("value.deserializer", StringDeserializer.class.getName());
        if (sync) {
            p.put("enable.auto.commit", "false");
        }
        int seen = 0;
        long deadline = System.currentTimeMillis() + timeoutMs;
        long last = 0;
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(p)) {
            consumer.subscribe(List.of(topic));
            while (seen < count && System.currentTimeMillis() < deadline
                    && (idleMs == 0 || seen == 0 || System.currentTimeMillis() - last < idleMs)) {
                ConsumerRecords<String, String> records = consumer.poll(Duration.ofMillis(200));
                if (sync && !records.isEmpty() && !commit(consumer, records, deadline)) {
                    // The group moved on without this member's commit: whoever has these
                    // partitions now reads them again from the committed offsets (this member
                    // too, if it kept them).
                    for (TopicPartition tp : records.partitions()) {
                        if (consumer.assignment().contains(tp)) {
                            consumer.seek(tp, records.records(tp).get(0).offset());
                        }
                    }
                    continue;
                }
                for (ConsumerRecord<String, String> r : records) {
                    System.out.println("record " + r.partition() + " " + r.offset() + " " + r.value());
                    seen++;
                    last = System.currentTimeMillis();
                }
            }
            consumer.commitSync();
        }
    }

    // Commits the offsets after `records`, retrying while the coordinator is away; false if the
    // group rebalanced meanwhile (the partitions may be another member's).
    static boolean commit(KafkaConsumer<String, String> consumer,
            ConsumerRecords<String, String> records, long deadline) {
        Map<TopicPartition, OffsetAndMetadata> offsets = new HashMap<>();
        for (TopicPartition tp : records.partitions()) {
            List<ConsumerRecord<String, String>> rs = records.records(tp);
            offsets.put(tp, new OffsetAndMetadata(rs.get(rs.size() - 1).offset() + 1));
        }
        while (System.currentTimeMillis() < deadline) {
            try {
                consumer.commitSync(offsets, Duration.ofSeconds(10));
                return true;
            } catch (CommitFailedException | RebalanceInProgressException e) {
                return false;
            } catch (RetriableException e) {
                // The coordinator is away (a broker restart): try again.
            }
        }
        return false;
    }
}
