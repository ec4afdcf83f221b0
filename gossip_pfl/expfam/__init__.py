"""Federated EM in sufficient-statistic space (Dieuleveut, Fort, Moulines, Robin 2021; seed 001).

``models``: exponential-family models (sbar, T, project); ``compress``: unbiased compressors with
their omega and bits; ``fedem``: the star algorithms (FedEM, naive, VR-FedEM) as functions over
all clients' statistics.
"""
