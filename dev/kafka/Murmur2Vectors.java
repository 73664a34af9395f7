// Prints the Java client's murmur2 and default keyed partition for a fixed set of keys,
// so sortie-wire can prove its partitioner matches byte for byte. Regenerate with:
//   java -cp 'target/kafka-test/libs/*' dev/kafka/Murmur2Vectors.java > services/wire/tests/data/murmur2-vectors.tsv
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import org.apache.kafka.common.utils.Utils;

public class Murmur2Vectors {
    public static void main(String[] args) {
        List<byte[]> keys = new ArrayList<>();
        String[] texts = {
            "", "a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh",
            "run_01JDXK3V8Q7Z6Y5W4T3S2R1P0N", "run_01JDXK3V8Q7Z6Y5W4T3S2R1P0M",
            "op_5f2c9a", "tenant-a/run-42", "refund@3", "\u00e9t\u00e9", "\u65e5\u672c\u8a9e",
            "\ud83d\ude80 sortie", "The quick brown fox jumps over the lazy dog",
        };
        for (String t : texts) keys.add(t.getBytes(StandardCharsets.UTF_8));
        for (int i = 0; i < 40; i++) keys.add(("run-" + i).getBytes(StandardCharsets.UTF_8));
        byte[] high = new byte[13];
        for (int i = 0; i < high.length; i++) high[i] = (byte) (0x80 + i * 9);
        keys.add(high);
        byte[] all = new byte[256];
        for (int i = 0; i < all.length; i++) all[i] = (byte) i;
        keys.add(all);
        System.out.println("key_hex\tmurmur2\tp1\tp3\tp12\tp100");
        HexFormat hex = HexFormat.of();
        for (byte[] k : keys) {
            int h = Utils.murmur2(k);
            StringBuilder line = new StringBuilder(hex.formatHex(k)).append('\t').append(h);
            for (int n : new int[] {1, 3, 12, 100}) line.append('\t').append(Utils.toPositive(h) % n);
            System.out.println(line);
        }
    }
}
