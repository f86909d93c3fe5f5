"""keras.io "Text classification with Transformer" (Apoorv Nandan; Keras 3 by Sitam Meur):
the transformer block, the token and position embedding and the classifier as written. The
data: token ids padded to maxlen, as keras.datasets.imdb and pad_sequences give them, made
here (a review is positive when words of the first half of the vocabulary dominate)."""
import keras
import numpy as np
from keras import layers, ops

EPOCHS, BATCH_SIZE, METRIC = 2, 32, "accuracy"


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


vocab_size = 2000  # the example: 20000
maxlen = 64  # the example: 200


def reviews(n, rng):
    labels = rng.integers(0, 2, n)
    lengths = rng.integers(maxlen // 4, maxlen, n)
    sequences = []
    for label, length in zip(labels, lengths):
        common = rng.integers(1, vocab_size, length)
        telling = rng.integers(1, vocab_size // 2, length) + (vocab_size // 2 - 1) * label
        sequences.append(np.where(rng.random(length) < 0.3, telling, common))
    return keras.utils.pad_sequences(sequences, maxlen=maxlen), labels.astype("int64")


_rng = np.random.default_rng(0)
(x_train, y_train), (x_val, y_val) = reviews(1024, _rng), reviews(256, _rng)


def data():
    return (x_train, y_train), (x_val, y_val)


def model(input_shape=None, num_classes=None):
    embed_dim = 32  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 32  # Hidden layer size in feed forward network inside transformer

    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)

    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model
