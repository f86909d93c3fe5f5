"""Two data sets of a project that is not an image classifier, made offline with numpy.

reviews(): short product reviews as text, turned into token ids by Keras's TextVectorization
(fitted on the training texts only), with their sentiment as class ids and names.
houses(): a house's price from its area and three ratings: named inputs, a float target.
"""
import keras
import numpy as np

POSITIVE = ["great", "love", "excellent", "perfect", "happy", "works", "recommend", "sturdy"]
NEGATIVE = ["broke", "awful", "refund", "poor", "returned", "useless", "cheap", "disappointed"]
NEUTRAL = ["arrived", "box", "color", "size", "ordered", "tuesday", "package", "manual"]
FILLER = ["the", "it", "was", "and", "a", "this", "my", "is", "very", "for", "with", "after"]
SENTIMENTS = ["negative", "neutral", "positive"]
WORDS_PER_REVIEW = 16  # token ids per review: longer ones are cut, shorter ones padded with 0


def _review(rng, sentiment):
    """A review of sentiment 0 (negative), 1 (neutral) or 2 (positive): filler words, a few
    neutral ones, and for a positive or negative review some words of its kind (and, now and
    then, one of the other kind: people hedge)."""
    words = list(rng.choice(FILLER, rng.integers(4, 9))) + list(rng.choice(NEUTRAL, 2))
    if sentiment != 1:
        own, other = (POSITIVE, NEGATIVE) if sentiment == 2 else (NEGATIVE, POSITIVE)
        words += list(rng.choice(own, rng.integers(1, 4)))
        if rng.random() < 0.3:
            words.append(rng.choice(other))
    rng.shuffle(words)
    return " ".join(words)


def reviews():
    rng = np.random.default_rng(11)

    def draw(n):
        labels = rng.integers(0, 3, n).astype("int32")
        return np.array([_review(rng, s) for s in labels]), labels

    (train_text, train_labels), (test_text, test_labels) = draw(4000), draw(1000)
    vectorize = keras.layers.TextVectorization(output_sequence_length=WORDS_PER_REVIEW)
    vectorize.adapt(train_text)
    tokens = [np.asarray(vectorize(text)).astype("int32") for text in (train_text, test_text)]
    return (tokens[0], train_labels), (tokens[1], test_labels), SENTIMENTS


def vocabulary_size():
    """Token ids run from 0 (padding) and 1 (a word not seen in training) to this, less one."""
    return 2 + len(set(POSITIVE + NEGATIVE + NEUTRAL + FILLER))


def houses():
    rng = np.random.default_rng(12)

    def draw(n):
        area = rng.uniform(20, 200, n).astype("float32")  # square metres
        ratings = rng.uniform(0, 1, (n, 3)).astype("float32")  # location, light, state
        price = (0.01 * area + ratings @ np.array([1.0, 0.3, 0.6], "float32")
                 + rng.normal(0, 0.05, n)).astype("float32")  # in units of 100,000
        return {"area": area / 100, "ratings": ratings}, price

    return draw(4000), draw(1000)
